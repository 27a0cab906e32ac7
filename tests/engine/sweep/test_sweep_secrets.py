"""A storage password, in any form (user:PW@host, ?password=PW, PGPASSWORD, a .pgpass file), is never
written where another user can read it: sweep.json shows the URL with *** for its password, the URL
itself goes to a file created 0600 from its first byte, and error lines show *** too. Checked with a
second, unprivileged user reading everything the sweep wrote (made with useradd when the tests run as
root, skipped otherwise)."""

import os
import shutil
import stat
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
from multilane.engine.errors import UserError
from postgres import pg_bin, postgres_server

SECRETS = ("PwInUrl-7c1", "PwInQuery-3f9", "PwInEnv-55a", "PwInPgpass-e02")


def test_private_files_are_0600_from_the_first_byte_whatever_the_umask_and_never_follow_a_symlink(tmp_path):
    from multilane.engine.sweep.storage_guard import write_private

    old = os.umask(0)
    try:
        write_private(tmp_path / "secret", b"pw")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "secret").stat().st_mode) == 0o600
    planted = tmp_path / f".trap.{os.getpid()}.tmp"  # where its temporary file would go
    planted.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError):
        write_private(tmp_path / "trap", b"pw")
    assert not (tmp_path / "elsewhere").exists()


def test_redact_hides_a_password_in_either_place():
    from multilane.engine.sweep.storage_guard import has_secret, redact

    assert redact("postgresql://u:pw@h/db?sslmode=x&password=q") == "postgresql://u:***@h/db?sslmode=x&password=***"
    assert redact("postgresql://u@h/db") == "postgresql://u@h/db" and not has_secret("postgresql://u@h/db")
    assert has_secret("postgresql://u:pw@h/db") and has_secret("postgresql://h/db?PASSWORD=x")


@pytest.mark.slow  # imports the database driver and connects
def test_error_lines_show_no_password():
    from multilane.engine.sweep.optuna_lib import rdb_storage

    for url in (f"postgresql+psycopg://u:{SECRETS[0]}@127.0.0.1:1/db", f"nosuch://u@h/db?password={SECRETS[1]}"):
        with pytest.raises(UserError) as e:
            rdb_storage(url)
        assert not any(s in str(e.value) for s in SECRETS), str(e.value)


@pytest.fixture
def other_user():
    if os.geteuid() != 0:
        pytest.skip("making a second user needs root (useradd)")
    if shutil.which("useradd") is None:
        pytest.skip("no useradd here")
    name = f"mlpw{uuid.uuid4().hex[:8]}"
    for _ in range(20):  # another test's useradd may hold /etc/passwd's lock a moment
        if subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/false", name]).returncode == 0:
            break
    else:
        pytest.fail("useradd failed")
    yield name
    subprocess.run(["userdel", name], check=False)


def _readable_by(user: str, path: Path) -> bytes | None:
    r = subprocess.run(["runuser", "-u", user, "--", "cat", str(path)], capture_output=True, timeout=60)
    return r.stdout if r.returncode == 0 else None


@pytest.mark.slow
@pytest.mark.skipif(pg_bin("initdb") is None, reason="PostgreSQL not installed (.ci/run installs it)")
def test_no_password_in_any_form_is_readable_by_another_user(other_user, monkeypatch):
    from multilane.engine.sweep.space import parse_params
    from multilane.engine.sweep.spec import SweepSpec
    from multilane.engine.sweep.study import Sweep

    # A folder other users can walk, as a home folder often is (pytest's own is 0700 for root).
    root = Path(tempfile.mkdtemp(prefix="multilane-secrets-"))
    root.chmod(0o755)
    try:
        home = root / "home"
        home.mkdir()
        with postgres_server() as url:  # postgresql+psycopg://postgres@127.0.0.1:PORT/postgres (trust: any password)
            host = url.split("@", 1)[1]
            (home / ".pgpass").write_text(f"127.0.0.1:*:*:postgres:{SECRETS[3]}\n")
            (home / ".pgpass").chmod(0o600)
            monkeypatch.setenv("HOME", str(home))
            monkeypatch.setenv("PGPASSWORD", SECRETS[2])
            params = parse_params(["optim.lr=log:1e-4:1e-1"], "digits")
            urls = {
                "in the url": f"postgresql+psycopg://postgres:{SECRETS[0]}@{host}",
                "as a query": f"postgresql+psycopg://postgres@{host}?password={SECRETS[1]}",
                "from the env and .pgpass": url,
            }
            for i, (how, u) in enumerate(urls.items()):
                sweep = Sweep.create(
                    SweepSpec(task="digits", params=params, trials=1, name=f"s{i}"), root / "sweeps", u
                )
                trial, _ = sweep.ask()
                sweep.study.tell(trial, 1.0)
                again = Sweep.open(sweep.folder)  # --resume finds the whole URL again
                assert again.storage_url == u, how
        seen = 0
        for path in root.rglob("*"):
            if path.is_file() and path.parent != home:
                got = _readable_by(other_user, path)
                if got is not None:
                    seen += 1
                    assert not any(s.encode() in got for s in SECRETS), f"{path} shows a password to another user"
                elif path.name == ".storage-url":
                    assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert seen >= 3  # the other user really read the sweep.json files (a test that looks)
        lock = Path(tempfile.gettempdir()) / f"multilane-sweep-ask-{os.getuid()}.lock"
        assert _readable_by(other_user, lock) is None  # the machine's ask lock: 0600 too
    finally:
        shutil.rmtree(root, ignore_errors=True)
