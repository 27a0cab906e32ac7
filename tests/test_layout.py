"""The engine is headless: it imports no Qt, and runs where PySide6 is not installed."""

import ast
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "engine"
QT = ("PySide6", "PyQt5", "PyQt6", "pyqtgraph", "shiboken6")


def test_engine_source_imports_no_qt():
    offenders, gui_users = [], []
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in QT]
            gui_users += [path.name for n in names if n.startswith("multilane.gui")]
    assert offenders == []
    # Only the CLI's no-argument app launcher reaches into the GUI, lazily, inside a function.
    assert set(gui_users) <= {"cli.py"}


def test_engine_trains_with_qt_unimportable(tmp_path):
    # Qt made unimportable in a real subprocess: the engine must still train (the GPU box has no PySide6).
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {QT!r}:
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
from multilane.engine.cli import main
sys.exit(main(['train', '--task', 'linear', '--steps', '3', '--devices', 'cpu:0,cpu:1',
               '--runs-dir', {str(tmp_path)!r}]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "finished: step 3/3" in r.stdout
