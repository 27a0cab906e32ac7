"""Every input a careless user or an attacker gave gets one line, never a traceback;
opening a run folder or a preset never runs code. Each case here gave a traceback (or worse) before."""

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from helpers import CLI
from multilane.engine.config import build_config, merge, read_config_file
from multilane.engine.errors import UserError
from multilane.engine.run.control import RunControl
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.writefile import check_writable
from multilane.engine.tasks import load_task_file, make_task


def multilane(*args, timeout=120, **kw):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, **kw)


def one_line(r) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.fixture
def run_folder(make_config):
    """A real, finished run (linear task, 2 steps, one lane, no telemetry)."""
    cfg = make_config(task__name="linear", train__steps=2, devices__use="cpu:0", telemetry__enabled=False)
    result = Trainer(cfg).run()
    assert result.status == "finished"
    return result.run_dir


# -- what export and Open run read -----------------------------------------------------------------

BAD_LINES = [
    b"\xff\xfe not utf-8 \x80\n",
    b'{"kind":"train","step":"abc","loss":1}\n',
    b'{"kind":"train","loss":1}\n',
    b'{"kind":"train","step":3,"loss":1,"device_loss":[1,2]}\n',
    b'{"kind":"train","step":4,"loss":1,"wall_time":"x"}\n',
    b'{"kind":"event","event":"started","step":1,"resumed_from_step":"x"}\n',
    b"[" * 100_000 + b"\n",
    b'{"kind":"train","step":' + b"9" * 5000 + b"}\n",
]


@pytest.mark.slow
def test_export_skips_bad_metrics_lines_with_a_count_and_survives_junk_files(run_folder, tmp_path):
    with open(run_folder / "metrics.jsonl", "ab") as f:
        f.write(b"".join(BAD_LINES))
    (run_folder / "config.json").write_text("[1]")
    (run_folder / "status.json").unlink()
    (run_folder / "status.json").mkdir()  # a folder where a file belongs
    r = multilane("export", str(run_folder), "--out", str(tmp_path / "out"), "--format", "csv,png")
    assert r.returncode == 0, r.stderr
    assert one_line(r).endswith(f"{len(BAD_LINES)} unreadable lines skipped")
    rows = (tmp_path / "out" / "metrics.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in rows[1:]] == ["1", "2"]  # the run's own two steps, nothing else
    assert (tmp_path / "out" / "loss.png").stat().st_size > 0
    assert not (tmp_path / "out" / "status.json").exists()


@pytest.mark.slow
def test_a_config_json_naming_a_task_of_the_wrong_type_is_ignored_by_export(run_folder, tmp_path):
    (run_folder / "config.json").write_text('{"task": "x"}')
    r = multilane("export", str(run_folder), "--out", str(tmp_path / "out"), "--format", "png")
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,words",
    [
        (["--width", "1000000"], "is too large (at most 10,000)"),
        (["--width", "9" * 5000], "is too large"),
        (["--out", "{run}"], "is the run folder itself"),
    ],
)
def test_export_refuses_bad_arguments_before_writing(run_folder, args, words):
    before = sorted(p.name for p in run_folder.iterdir())
    args = [a.replace("{run}", str(run_folder)) for a in args]
    if "--out" not in args:
        args += ["--out", str(run_folder.parent / "out")]
    r = multilane("export", str(run_folder), *args)
    assert r.returncode == 2 and words in one_line(r)
    assert sorted(p.name for p in run_folder.iterdir()) == before


@pytest.mark.slow
def test_a_metrics_file_that_is_a_folder_is_one_line(run_folder, tmp_path):
    (run_folder / "metrics.jsonl").unlink()
    (run_folder / "metrics.jsonl").mkdir()
    r = multilane("export", str(run_folder), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "cannot read metrics.jsonl (a folder, not a file)" in one_line(r)


def test_open_run_in_the_app_counts_skipped_lines_and_refuses_a_folder_for_metrics(qtbot, run_folder, tmp_path):
    pytest.importorskip("PySide6")
    from multilane.gui.window.main_window import MainWindow
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QMessageBox

    w = MainWindow(QSettings(str(tmp_path / "s.ini"), QSettings.IniFormat))
    qtbot.addWidget(w)
    with open(run_folder / "metrics.jsonl", "ab") as f:
        f.write(b"".join(BAD_LINES))
    assert w.open_run(str(run_folder))
    assert f"({len(BAD_LINES)} unreadable lines skipped)" in w.status_label.text()
    assert w.plots.data.train.rows == 2
    (run_folder / "metrics.jsonl").unlink()
    (run_folder / "metrics.jsonl").mkdir()
    shown = []
    qtbot_patch = pytest.MonkeyPatch()
    qtbot_patch.setattr(QMessageBox, "warning", lambda *a: shown.append(a[2]))
    try:
        assert not w.open_run(str(run_folder))
    finally:
        qtbot_patch.undo()
    assert "a folder, not a file" in shown[0]


# -- config files and --set -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,content,words",
    [
        ("deep.json", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("deep.toml", "a = " + "[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("deep2.json", '{"task": {"params": ' + '{"a": ' * 40 + "1" + "}" * 40 + "}}", "nested more than 32"),
        ("big.json", '{"train": {"steps": ' + "9" * 5000 + "}}", "Exceeds the limit (4300 digits)"),
        ("big.toml", "[train]\nsteps = " + "9" * 5000, "Exceeds the limit (4300 digits)"),
        ("nul.json", '{"run": {"runs_dir": "a\\u0000b"}}', "run.runs_dir"),
        ("nan.json", '{"devices": {"weights": [NaN, 1]}}', "devices.weights.0"),
        ("inf.json", '{"devices": {"weights": [Infinity, 1]}}', "finite"),
        ("huge.json", '{"devices": {"weights": [1e308, 1e308]}}', "less than or equal to 1000000"),
        ("junk.json", '{"optim": "garbage"}', "optim"),
        ("steps.json", '{"train": {"steps": 99999999999999999}}', "train.steps"),
    ],
)
def test_a_config_that_breaks_the_parser_or_the_run_later_is_one_line(tmp_path, name, content, words):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(UserError) as info:
        build_config(merge(read_config_file(path), {"optim.lr": 0.1}), str(path))
    assert words in str(info.value) and "\n" not in str(info.value)


def test_a_junk_section_is_named_even_when_a_flag_sets_a_key_in_it():
    with pytest.raises(UserError, match=r'config: optim = "garbage": Input should be .*dictionary'):
        build_config(merge({"optim": "garbage"}, {"optim.lr": 0.1}))


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_a_config_path_that_is_a_device_or_a_fifo_is_refused_at_once(tmp_path, special):
    path = Path(special)
    if special == "fifo":
        path = tmp_path / "c.json"
        os.mkfifo(path)
    box: list = []
    t = threading.Thread(target=lambda: box.append(_refusal(path)), daemon=True)
    t.start()
    t.join(10)
    assert box, "reading the config hung"
    assert "cannot read it as a config file (a " in box[0]


def _refusal(path):
    try:
        read_config_file(path)
    except UserError as e:
        return str(e)
    return "accepted"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,words",
    [
        (["--lr", "nan"], "optim.lr = NaN: Input should be a finite number"),
        (["--set", "..=1"], "'..' is not a key"),
        (["--set", "train.steps=" + "9" * 5000], "Exceeds the limit (4300 digits)"),
        (["--steps", "9" * 5000], "is too large"),
        (["--seed", "9" * 5000], "is too large"),
        (["--runs-dir", "/proc"], "runs folder /proc: not writable (this file system does not take new files)"),
        (["--set", "devices.weights=[1e308, 1e308]"], "devices.weights.0"),
    ],
)
def test_misleading_messages_now_say_what_is_wrong(tmp_path, args, words):
    r = multilane("train", "--task", "linear", "--steps", "1", "--devices", "cpu:0", *args)
    assert r.returncode == 2 and words in one_line(r)


# -- --resume on a run folder that is not what it should be ---------------------------------------


def _save(path, obj):
    torch.save(obj, path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "change,words",
    [
        (lambda ck: _save(ck, [1, 2, 3]), "not a Multilane checkpoint (it holds a list"),
        (lambda ck: _save(ck, {**torch.load(ck, weights_only=True), "step": -5}), "step = -5: not a whole number"),
        (lambda ck: ck.write_bytes(os.urandom(4096)), "cannot load it ("),
        (lambda ck: _save(ck, {"model": threading.Lock}), "cannot load it (it holds something other than"),
    ],
)
def test_resume_from_a_bad_checkpoint_is_one_line_without_torchs_unsafe_advice(run_folder, change, words):
    change(run_folder / "checkpoints" / "last.pt")
    r = multilane("train", "--resume", str(run_folder), "--steps", "4")
    line = one_line(r)
    assert r.returncode == 2 and words in line and "weights_only" not in line


@pytest.mark.parametrize("name", ["status.json", "config.json", "metrics.jsonl"])
def test_resume_into_a_folder_whose_file_is_a_folder_is_refused_and_leaves_nothing(run_folder, name):
    (run_folder / name).unlink()
    (run_folder / name).mkdir()
    with pytest.raises(UserError, match=f"{name} is a folder; a run folder's {name} must be a plain file"):
        Trainer(resume_from=run_folder)
    assert not [p for p in run_folder.rglob("*.tmp")]


def test_resume_into_a_read_only_folder_is_refused(run_folder, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(run_folder), str(ro)], capture_output=True).returncode:
        pytest.skip("needs a bind mount (root)")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode:
            pytest.skip("cannot remount read-only")
        with pytest.raises(UserError, match=r"resume: run folder .*: not writable \(Read-only file system\)"):
            Trainer(resume_from=ro)
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    assert not list(run_folder.rglob("*.tmp"))


def test_the_write_probe_never_follows_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    runs = tmp_path / "runs"
    runs.mkdir()
    for pid in range(os.getpid() - 2, os.getpid() + 3):  # the old probe's name, for any pid nearby
        (runs / f".multilane-write-test-{pid}").symlink_to(victim)
    check_writable(runs)
    assert victim.read_text() == "keep me"
    assert sorted(p.name for p in runs.iterdir() if not p.is_symlink()) == []


# -- task files -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_sys_exit_at_import_is_an_error_not_a_silent_exit(tmp_path):
    task = tmp_path / "exits.py"
    task.write_text("import sys\nsys.exit(0)\n")
    r = multilane("train", "--task", str(task), "--steps", "1", "--runs-dir", str(tmp_path / "runs"))
    assert r.returncode == 2
    assert f"task file {task}: SystemExit while importing it (line 2)" in one_line(r)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "body,words",
    [
        ("    Params = dict\n", "Bad.Params must be a pydantic BaseModel subclass (it is dict)"),
        (
            "    def __init__(self, params=None):\n        raise RuntimeError('no GPU here')\n",
            "RuntimeError while creating it (line 4): no GPU here",
        ),
        (
            "    def __init__(self, params=None):\n        raise SystemExit(3)\n",
            "SystemExit while creating it (line 4): 3",
        ),
    ],
)
def test_a_task_class_that_breaks_is_one_line(tmp_path, body, words):
    task = tmp_path / "bad.py"
    task.write_text("from multilane.engine.tasks.builtin import LinearTask\nclass Bad(LinearTask):\n" + body)
    with pytest.raises(UserError) as info:
        make_task(str(task))
    assert words in str(info.value) and "\n" not in str(info.value)


def test_loading_a_task_file_hashes_exactly_the_bytes_that_run(tmp_path):
    from multilane.engine.tasks.loader import file_sha256, task_file_record

    task = tmp_path / "t.py"
    task.write_text("from multilane.engine.tasks.builtin import LinearTask\nclass T(LinearTask):\n    name = 't'\n")
    cls = load_task_file(task)
    assert task_file_record(cls) == {"path": str(task.resolve()), "sha256": file_sha256(task.read_bytes())}
    with pytest.raises(UserError, match="changed while it was being checked"):
        load_task_file(task, expect_sha256="0" * 64)


@pytest.mark.slow
def test_loading_a_preset_or_the_last_config_never_imports_its_task_file(qtbot, tmp_path):
    pytest.importorskip("PySide6")
    from multilane.engine.config import RunConfig, save_config
    from multilane.gui.window.main_window import MainWindow
    from PySide6.QtCore import QSettings

    marker = tmp_path / "ran"
    task = tmp_path / "payload.py"
    task.write_text(
        f"open({str(marker)!r}, 'a').write('x')\n"
        "from multilane.engine.tasks.builtin import LinearTask\nclass P(LinearTask):\n    name = 'p'\n"
    )
    cfg = RunConfig.model_validate({"task": {"name": str(task), "params": {"samples": 64}}})
    save_config(cfg, tmp_path / "preset.toml")
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.IniFormat)
    w = MainWindow(settings)
    qtbot.addWidget(w)
    w.load_preset(str(tmp_path / "preset.toml"))
    assert w.form.values()["task"] == {"name": str(task), "params": {"samples": 64}}
    assert w.validate() == [] and w.start_btn.isEnabled()
    assert "not loaded yet" in w.form.task_combo.toolTip()
    settings.setValue("last_config", json.dumps(cfg.to_dict()))
    again = MainWindow(settings)
    qtbot.addWidget(again)
    assert again.form.values()["task"]["name"] == str(task)
    assert not marker.exists()  # neither the preset nor the start-up ran the file
    again.form.editors["run.runs_dir"].widget.setText(str(tmp_path / "runs"))
    again.form.editors["train.steps"].widget.setValue(2)
    again.devices.set_checked(["cpu:0"])
    assert again.start_btn.isEnabled(), again.why.text()
    again.start()
    assert f"running task file {task.resolve()}" in again.status_label.text()
    qtbot.waitUntil(lambda: not again.is_running(), timeout=120_000)
    assert again.last_result["status"] == "finished", again.last_result
    assert marker.read_text() == "x"  # Start ran it, once


@pytest.mark.slow
@pytest.mark.parametrize("agree", [False, True])
def test_the_app_asks_before_resuming_with_a_changed_task_file(qtbot, tmp_path, make_config, monkeypatch, agree):
    pytest.importorskip("PySide6")
    from multilane.gui.window.main_window import MainWindow
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QMessageBox

    marker = tmp_path / "ran"
    task = tmp_path / "mine.py"
    source = "from multilane.engine.tasks.builtin import LinearTask\nopen({m!r}, 'a').write({t!r})\nclass M(LinearTask):\n    name = 'm'\n"
    task.write_text(source.format(m=str(marker), t="a"))
    cfg = make_config(task__name=str(task), train__steps=2, devices__use="cpu:0", telemetry__enabled=False)
    stop = RunControl()
    stop.request_stop()  # stopped at step 0 with its checkpoint: a resume has steps left to train
    run = Trainer(cfg, control=stop).run().run_dir
    task.write_text(source.format(m=str(marker), t="b"))
    asked = []

    def question(parent, title, text, *rest):
        asked.append(text)
        return QMessageBox.Yes if agree else QMessageBox.No

    monkeypatch.setattr(QMessageBox, "question", question)
    w = MainWindow(QSettings(str(tmp_path / "s.ini"), QSettings.IniFormat))
    qtbot.addWidget(w)
    w.start(resume_from=str(run))
    qtbot.waitUntil(lambda: bool(asked) and not w.is_running(), timeout=120_000)
    assert f"the run's task file {task.resolve()} changed since the run started" in asked[0]
    assert f"Resume the run with {task.resolve()} as it is now?" in asked[0]
    if agree:
        assert w.last_result["status"] == "finished", w.last_result
        assert marker.read_text() == "ab"
    else:
        assert "Not resumed" in w.status_label.text() and marker.read_text() == "a"


def test_a_user_error_is_one_line_whatever_characters_the_input_held():
    from multilane.engine.errors import UserError

    text = str(UserError("task file a/\x1cb\nc\u2028d: no such file"))
    assert len(text.splitlines()) == 1
    assert "\\x1c" in text and "\\n" in text and "\\u2028" in text
