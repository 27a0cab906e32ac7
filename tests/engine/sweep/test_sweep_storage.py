"""A sweep's storage survives a crash and is never made worse: a journal whose last record was cut at any
byte is cut back to its last whole record (the dropped bytes kept beside it, one warning) before anything
is written, and plain optuna.load_study opens the study after; an empty, junk, foreign or newer-format
journal or SQLite file is one line naming it, and is left byte for byte as it was."""

import json
import shutil
import sqlite3
import tempfile
from pathlib import Path

import pytest
from multilane.engine.errors import UserError
from sweep_helpers import load_journal, sweep_cli


def _make(tmp_path, storage=None, name="s"):
    from multilane.engine.sweep.space import parse_params
    from multilane.engine.sweep.spec import SweepSpec
    from multilane.engine.sweep.study import Sweep

    params = parse_params(["optim.lr=log:1e-4:1e-1"], "digits")
    sweep = Sweep.create(SweepSpec(task="digits", params=params, trials=3, seed=1, name=name), tmp_path, storage)
    for _ in range(2):
        trial, p = sweep.ask()
        sweep.study.tell(trial, p["optim.lr"])
    return sweep


@pytest.fixture
def fast_tmp(tmp_path):
    """A folder in memory where there is one (/dev/shm): the test below syncs the journal ~500 times."""
    if not Path("/dev/shm").is_dir():
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="multilane-journal-", dir="/dev/shm"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow  # ~150 cuts, each opened, written and loaded: 4-8 s
def test_a_journal_cut_at_every_byte_of_its_last_record_is_cut_back_and_optuna_opens_it(fast_tmp, capsys):
    from multilane.engine.sweep.study import Sweep

    tmp_path = fast_tmp
    made = _make(tmp_path / "made")
    data = (made.folder / "study.journal").read_bytes()
    start = data[:-1].rfind(b"\n") + 1  # where the last record begins
    folder = tmp_path / "cut"
    for k in range(start, len(data)):  # k == start: whole records only, nothing to cut
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        shutil.copy(made.folder / "sweep.json", folder)
        (folder / "study.journal").write_bytes(data[:k])
        sweep = Sweep.open(folder)  # what `sweep --resume`, the app's open and a worker do first
        sweep.recover_lost()
        sweep.study.set_user_attr("after", k)  # a write after the repair
        err = capsys.readouterr().err
        kept = list(folder.glob("study.journal.torn-*"))
        if k == start:
            assert not err and not kept
        else:
            assert err.count("\n") == 1 and f"{k - start} bytes dropped" in err and kept[0].name in err
            assert kept[0].read_bytes() == data[start:k]
        assert (folder / "study.journal").read_bytes().startswith(data[:start])
        study = load_journal(folder)  # plain Optuna
        assert study.user_attrs["after"] == k
        assert len(study.trials) == 2 and study.trials[0].value == made.study.trials[0].value
        if k == start:  # the cut record was the last trial's end: without it the trial is still running
            assert study.trials[1].value is None


def _cases(tmp_path):
    made = _make(tmp_path / "made")
    good = (made.folder / "study.journal").read_bytes()
    record = json.loads(good.splitlines()[-1])
    return {
        "empty": b"",
        "junk": bytes(range(256)) * 4,
        "junk lines": b"\x00\xff\x13\n" * 8,
        "torn only": good[:40],
        "foreign json": b'{"name": "not optuna"}\n',
        "no study first": good.split(b"\n", 1)[1],
        "newer format": good + json.dumps({**record, "op_code": 99}).encode() + b"\n",
    }, made


@pytest.mark.parametrize(
    "case", ["empty", "junk", "junk lines", "torn only", "foreign json", "no study first", "newer format"]
)
def test_a_journal_that_is_no_optuna_journal_is_one_line_and_left_as_it_was(tmp_path, case):
    from multilane.engine.sweep.study import Sweep

    cases, made = _cases(tmp_path)
    folder = tmp_path / "bad"
    folder.mkdir()
    shutil.copy(made.folder / "sweep.json", folder)
    (folder / "study.journal").write_bytes(cases[case])
    with pytest.raises(UserError) as e:
        Sweep.open(folder)
    assert str(folder / "study.journal") in str(e.value) and "\n" not in str(e.value)
    assert (folder / "study.journal").read_bytes() == cases[case]
    assert sorted(p.name for p in folder.iterdir()) == ["study.journal", "sweep.json"]


@pytest.fixture(scope="module")
def sqlite_cases(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("sqlite")
    ok = tmp_path / "ok.db"
    _make(tmp_path / "made", f"sqlite:///{ok}")
    foreign = tmp_path / "foreign.db"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE notes (x TEXT)")
    con.commit()
    con.close()
    newer = tmp_path / "newer.db"
    shutil.copy(ok, newer)
    con = sqlite3.connect(newer)
    con.execute("UPDATE alembic_version SET version_num = 'v9.9.9.a'")
    con.commit()
    con.close()
    empty, junk = tmp_path / "empty.db", tmp_path / "junk.db"
    empty.write_bytes(b"")
    junk.write_bytes(b"SQLite? no\x00" * 100)
    return {"empty": empty, "junk": junk, "foreign": foreign, "newer format": newer}


@pytest.mark.slow  # making an Optuna SQLite database (alembic) takes seconds
@pytest.mark.parametrize("case", ["empty", "junk", "foreign", "newer format"])
def test_an_sqlite_file_that_is_no_optuna_storage_is_one_line_and_left_as_it_was(tmp_path, sqlite_cases, case):
    from multilane.engine.sweep.study import Sweep

    db = tmp_path / sqlite_cases[case].name
    shutil.copy(sqlite_cases[case], db)
    before = db.read_bytes()
    for attempt in ("join", "create"):
        with pytest.raises(UserError) as e:
            if attempt == "join":
                Sweep.join(f"sqlite:///{db}", "s", tmp_path / "w")
            else:
                _make(tmp_path / "new", f"sqlite:///{db}", name="t")
        assert str(db) in str(e.value) and "\n" not in str(e.value)
        assert db.read_bytes() == before
    assert not (tmp_path / "new").exists() or not any((tmp_path / "new").iterdir())


@pytest.mark.slow
def test_the_cli_refuses_a_junk_journal_with_exit_2_and_cuts_a_torn_one(tmp_path):
    made = _make(tmp_path)
    journal = made.folder / "study.journal"
    good = journal.read_bytes()
    journal.write_bytes(b"\x00junk\xff" * 50)
    r = sweep_cli("sweep", "--resume", str(made.folder), "--devices", "cpu:0", timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and str(journal) in r.stderr, r.stderr
    assert journal.read_bytes() == b"\x00junk\xff" * 50
    journal.write_bytes(good + b'{"op_code": 6, "worker')  # torn: resume cuts it (its 2 trials are done)
    r = sweep_cli("sweep", "--resume", str(made.folder), "--devices", "cpu:0", "--trials", "2", timeout=600)
    assert r.returncode == 0 and "22 bytes dropped" in r.stderr, r.stderr
    assert journal.read_bytes() == good
    assert len(load_journal(made.folder).trials) == 2
