"""The layout: the engine is headless (no Qt, runs where PySide6 is not installed); every folder is a room
named for its job, of at most 12 modules, whose modules import nothing from the folders above them."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"
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
    assert set(gui_users) <= {"main.py"}


@pytest.mark.slow
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


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def _packages() -> list[tuple[str, Path]]:
    return [
        ("multilane." + ".".join(d.relative_to(ROOT).parts), d)
        for top in ("engine", "gui")
        for d in [ROOT / top, *sorted(p for p in (ROOT / top).rglob("*") if p.is_dir())]
        if (d / "__init__.py").exists()
    ]


def test_every_folder_is_a_package_of_at_most_twelve_modules_with_a_one_line_purpose():
    for name, folder in _packages():
        modules = [p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
        assert len(modules) <= 12, f"{name} holds {len(modules)} modules"
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc, f"{name}/__init__.py says nothing of what the folder is for"


def test_no_module_imports_a_module_of_a_folder_above_it():
    # A subpackage's modules may use their own folder and its sub-folders, or another room, but not the
    # folder that contains theirs (its parts sit above them): a circle in the making.
    offenders = []
    for name, folder in _packages():
        for path in folder.rglob("*.py"):
            if path.name == "__init__.py" and path.parent == folder:
                continue
            mod_pkg = "multilane." + ".".join(path.parent.relative_to(ROOT).parts)
            if mod_pkg == name:
                continue
            for imported in _imports(path):
                parts = imported.split(".")
                # a module directly in the upper folder `name` (not in the lower one)
                upper = ".".join(parts[:-1]) == name and not mod_pkg.startswith(imported)
                if upper and (folder / f"{parts[-1]}.py").exists():
                    offenders.append(f"{path.relative_to(ROOT)} imports {imported}")
    # engine's root holds what every part uses (config, errors, exports, numbers); every room may use those.
    shared = {f"multilane.engine.{m}" for m in ("config", "errors", "exports", "numbers")}
    assert [o for o in offenders if o.split(" imports ")[1] not in shared] == []


def test_no_module_defines_a_constant_twice():
    # MAX_CPU_LANES = 64, then MAX_CPU_LANES = 8 lower in the same module: the second silently won and
    # 9 to 64 CPU lanes were refused. ruff has no rule for a module constant assigned twice.
    twice = []
    for top in ("engine", "gui", "bench"):
        for path in sorted((ROOT / top).rglob("*.py")):
            seen: set[str] = set()
            for node in ast.parse(path.read_text()).body:
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                for t in targets:
                    if isinstance(t, ast.Name) and t.id.isupper() and isinstance(node, ast.Assign | ast.AnnAssign):
                        if t.id in seen:
                            twice.append(f"{path.relative_to(ROOT)}: {t.id}")
                        seen.add(t.id)
    assert twice == []


@pytest.mark.slow
def test_public_names_of_the_docs_import_from_the_engine_without_torch():
    code = (
        "import sys; import multilane.engine as e; import multilane.engine.run, multilane.engine.rundir, "
        "multilane.engine.cli.parser, multilane.gui.plots; assert 'torch' not in sys.modules, 'torch'; "
        "from multilane.engine import Trainer, RunConfig, Task, ArrayData, build_config; "
        "from multilane.engine.tasks import Task as T; assert T is Task; print(Trainer.__module__)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "multilane.engine.run.trainer"


def test_every_package_folder_is_in_pyprojects_packages_list():
    """A folder with an ``__init__.py`` that pyproject's explicit ``packages`` list leaves out is missing from
    a non-editable install (a wheel), while every editable install still finds it."""
    import os
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    mapped = {folder: name for name, folder in setup["package-dir"].items()}
    missing = []
    for top in ("engine", "gui"):
        for folder, dirs, files in os.walk(ROOT / top):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = Path(folder).relative_to(ROOT).as_posix()
            if "__init__.py" not in files:
                continue
            base = next((f for f in sorted(mapped, key=len, reverse=True) if rel == f or rel.startswith(f + "/")), None)
            name = mapped[base] + rel[len(base) :].replace("/", ".")
            if name not in listed:
                missing.append(name)
    assert not missing, f"pyproject.toml's packages list lacks {missing}"


def _runtime_imports(tree: ast.AST) -> list[str]:
    """The modules a file imports when it runs: ``if TYPE_CHECKING:`` blocks (annotations only) aside."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for n in node.orelse:
                visit(n)
            return
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.extend([node.module] + [f"{node.module}.{a.name}" for a in node.names])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def test_no_two_folders_import_each_other_at_run_time():
    # A room that imports another which imports it back: neither owns the step between them (fourteen
    # such pairs once; the loop, its strategies and its instruments now point one way).
    folders = {name: folder for name, folder in _packages()}
    edges: set[tuple[str, str]] = set()
    for name, folder in folders.items():
        for path in folder.glob("*.py"):
            for imported in _runtime_imports(ast.parse(path.read_text(), str(path))):
                target = next((f for f in sorted(folders, key=len, reverse=True) if imported.startswith(f + ".")), None)
                target = imported if imported in folders else target
                if target is not None and target != name:
                    edges.add((name, target))
    pairs = sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges})
    # engine's root holds what every room uses (config, errors, ...), and the run folder's room reads config
    assert [p for p in pairs if p != ("multilane.engine", "multilane.engine.rundir")] == []


def test_the_instruments_never_name_the_loop():
    # An instrument is handed what it needs (a replay gets the loop's side of it, ``StepReplay``; the
    # report its events and callbacks): no module of engine/health imports engine/run, even for hints.
    for path in (ENGINE / "health").glob("*.py"):
        named = [n for n in _imports(path) if n.startswith(("multilane.engine.run", "multilane.engine.distributed"))]
        assert named == [], f"{path.name} imports {named}"
