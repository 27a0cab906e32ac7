"""Which of the project's modules the fast tier runs (issue 30: "a fast tier ... covering every module
at least once"): the fast tier under coverage.py (pytest-cov), then every module of engine/ and gui/
that no fast test executed a line of, in the tests' own processes.

    python bench/fast_tier_modules.py            # the fast tier, `pytest -m "not slow"`, with coverage
    python bench/fast_tier_modules.py --all      # the same list for the whole suite

Only the test processes are measured: a module that runs only in a process the test starts (a `multilane`
command, a ddp rank, a Lightning script) is listed, so the list is an upper bound of what the tier
leaves out; each module left is named in docs/performance.md with the tests that run it.
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="the whole suite, not only the fast tier")
    args = parser.parse_args()
    try:
        import pytest_cov  # noqa: F401
    except ImportError:
        print("fast_tier_modules: needs pytest-cov (pip install -e '.[test]' has it)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fast-tier-cov-") as tmp:
        report = Path(tmp) / "coverage.json"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp}/bt",
               "--cov=multilane", f"--cov-report=json:{report}"]  # fmt: skip
        cmd += [] if args.all else ["-m", "not slow"]
        done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "COVERAGE_FILE": f"{tmp}/.coverage"})
        if not report.is_file():
            print(f"fast_tier_modules: pytest ended with {done.returncode} and wrote no coverage", file=sys.stderr)
            return 1
        files = json.loads(report.read_text())["files"]
    paths = {(ROOT / name).resolve(): f["summary"]["covered_lines"] for name, f in files.items()}
    ran = {str(p.relative_to(ROOT)) for p, lines in paths.items() if lines > 0 and p.is_relative_to(ROOT)}
    modules = sorted(
        str(p.relative_to(ROOT)) for d in ("engine", "gui") for p in (ROOT / d).rglob("*.py") if p.name != "__init__.py"
    )
    left = [m for m in modules if m not in ran]
    tier = "the whole suite" if args.all else "the fast tier"
    print(f"{len(modules) - len(left)} of {len(modules)} modules run in {tier}'s own processes; not run there:")
    for m in left:
        print(f"  {m}")
    return 0 if done.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
