"""How many tests and assertions the suite holds, and how many of them the fast tier runs.

    python bench/suite_census.py            # tests collected, in all and in `-m "not slow"`; asserts in tests/
    python bench/suite_census.py --by-file  # the same per test file

"Assertions" counts what can fail in the test code as written: every ``assert`` statement and every
``pytest.raises``/``pytest.warns`` block, read from the source with ``ast`` (a parametrized test's
assertions count once). The count of tests is pytest's own collection. The fast-tier work compared both before
and after the suite was made fast, so that "no test weaker" is a number, not a claim.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def is_assertion(node: ast.AST) -> bool:
    if isinstance(node, ast.Assert):
        return True
    call = node.func if isinstance(node, ast.Call) else None
    return (
        isinstance(call, ast.Attribute)
        and call.attr in ("raises", "warns")
        and getattr(call.value, "id", "") == "pytest"
    )


def assertions(path: Path) -> int:
    return sum(is_assertion(node) for node in ast.walk(ast.parse(path.read_text(), str(path))))


def collected(*args: str) -> Counter[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-n0", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    per_file: Counter[str] = Counter()
    for line in out.splitlines():
        m = re.match(r"^(tests/[^:]+\.py)::", line)
        if m:
            per_file[m.group(1)] += 1
    return per_file


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--by-file", action="store_true", help="a row per test file")
    args = parser.parse_args()
    every, fast = collected(), collected("-m", "not slow")
    asserts = {str(p.relative_to(ROOT)): assertions(p) for p in sorted(TESTS.rglob("*.py"))}
    if args.by_file:
        print(f"{'file':64} {'tests':>6} {'fast':>6} {'asserts':>8}")
        for f in sorted(set(every) | {k for k, v in asserts.items() if v}):
            print(f"{f:64} {every[f]:6} {fast[f]:6} {asserts.get(f, 0):8}")
    no_fast = sorted(f for f in every if not fast[f])
    print(f"tests: {sum(every.values())} collected, {sum(fast.values())} in the fast tier (-m 'not slow')")
    print(f"assertions in tests/: {sum(asserts.values())} (assert statements and pytest.raises/warns blocks)")
    print(
        f"test files: {len(every)}, with no fast test: {len(no_fast)}" + (f" ({', '.join(no_fast)})" if no_fast else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
