"""Which of the project's modules the fast tier runs ("a fast tier ... covering every module
at least once"): the fast tier under coverage.py (pytest-cov), then every module of engine/ and gui/
in which no fast test ran a line of a function (importing a module runs its ``def`` lines, not them).

    python bench/fast_tier_modules.py            # the fast tier, `pytest -m "not slow"`, with coverage
    python bench/fast_tier_modules.py --all      # the same list for the whole suite
    python bench/fast_tier_modules.py --own      # only the tests' own processes

By default every Python process the tests start is measured as well (coverage.py's ``patch`` of
subprocesses, forks and ``os._exit``): a `multilane` command, a ddp rank, a Lightning script, a child
forked from the suite's warm server. With ``--own`` only the pytest workers are, so a module that runs
only in a process the test starts is listed. Each module left is named in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ran(entry: dict | None) -> bool:
    """A line inside one of the module's functions ran (importing runs only its ``def`` lines); a module
    without functions ran when it was imported."""
    if not entry:
        return False
    functions = {k: f for k, f in entry.get("functions", {}).items() if k}  # "" is the module's own lines
    if not functions:
        return bool(entry.get("executed_lines"))
    return any(f.get("executed_lines") for f in functions.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="the whole suite, not only the fast tier")
    parser.add_argument("--report", type=Path, help="also keep coverage.py's JSON report here")
    parser.add_argument("--own", action="store_true", help="only the tests' own processes, not those they start")
    args = parser.parse_args()
    try:
        import pytest_cov  # noqa: F401
    except ImportError:
        print("fast_tier_modules: needs pytest-cov (pip install -e '.[test]' has it)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fast-tier-cov-") as tmp:
        report = Path(tmp) / "coverage.json"
        rc = Path(tmp) / "coveragerc"
        patch = "" if args.own else "patch = subprocess\n    fork\n    _exit\nsigterm = true\n"
        rc.write_text(f"[run]\nparallel = true\n{patch}disable_warnings = no-data-collected\n    module-not-measured\n")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp}/bt",
               "--cov=multilane", f"--cov-config={rc}", f"--cov-report=json:{report}"]  # fmt: skip
        cmd += [] if args.all else ["-m", "not slow"]
        done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "COVERAGE_FILE": f"{tmp}/.coverage"})
        if not report.is_file():
            print(f"fast_tier_modules: pytest ended with {done.returncode} and wrote no coverage", file=sys.stderr)
            return 1
        files = json.loads(report.read_text())["files"]
        if args.report:
            args.report.write_text(report.read_text())
    found = {(ROOT / name).resolve(): f for name, f in files.items()}
    modules = sorted(
        str(p.relative_to(ROOT)) for d in ("engine", "gui") for p in (ROOT / d).rglob("*.py") if p.name != "__init__.py"
    )
    ran = [m for m in modules if _ran(found.get((ROOT / m).resolve()))]
    imported = [m for m in modules if m not in ran and found.get((ROOT / m).resolve(), {}).get("executed_lines")]
    left = [m for m in modules if m not in ran and m not in imported]
    tier = "the whole suite" if args.all else "the fast tier"
    where = "its own processes" if args.own else "its processes and those they start"
    print(f"{len(ran)} of {len(modules)} modules run in {tier} ({where}): a line of one of their functions ran")
    for title, names in (("only imported (no line of a function ran)", imported), ("never imported", left)):
        print(f"{len(names)} {title}" + (":" if names else ""))
        for m in names:
            print(f"  {m}")
    return 0 if done.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
