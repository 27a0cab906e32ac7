"""The documents a newcomer reads first stay short and true: README is at most 300 lines and opens with
the two commands (launch the app; run the whole suite), every relative link in README and docs/ leads
to a file that exists, docs/README.md indexes every document, and no tracked file points at a work item
or a work session by number instead of stating the rule or the fact itself."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

APP_COMMAND = 'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[gui]" && multilane'
SUITE_COMMAND = 'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[test]" && pytest'

# A work item or session named by its number: "issue" and a number (with or without "#"), a bare "#"
# and one or two digits (a colour such as "#333" has three), "round" and a number or a number word,
# "session" and a number. Written in pieces so that this file does not match itself.
WORK_REF = re.compile(
    r"\bissues? ?#?\d+"
    r"|(?<![\w/.&-])#\d{1,2}\b(?![-.]\d)"
    r"|\bround[ _-]?(?:\d+|one|two|three|four|five|six|seven|eight|nine|ten)\b"
    r"|\bsession \d+",
    re.IGNORECASE,
)


def _blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, the block's text) of every fenced code block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, i = i, i + 1
            body = []
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append((start, "\n".join(body).strip()))
        i += 1
    return blocks


def _heading_above(text: str, line: int) -> str:
    for row in reversed(text.splitlines()[:line]):
        if row.startswith("#"):
            return row
    return ""


def test_readme_is_short_and_opens_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 300, f"README.md has {len(text.splitlines())} lines: move detail into docs/"
    (app_line, app), (suite_line, suite) = _blocks(text)[:2]
    assert app == APP_COMMAND
    assert suite == SUITE_COMMAND
    # The suite's command sits under a heading of its own, right after the app's, not inside prose.
    app_heading, suite_heading = _heading_above(text, app_line), _heading_above(text, suite_line)
    assert suite_heading and suite_heading != app_heading
    between = text.splitlines()[app_line:suite_line]
    assert [row for row in between if row.startswith("#")] == [suite_heading]


def test_ci_runs_the_readmes_suite_command():
    assert SUITE_COMMAND in (ROOT / ".ci" / "run").read_text().splitlines()


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_in_readme_and_docs_leads_somewhere():
    broken = []
    for md in [README, *sorted(DOCS.glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", md.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", dest.read_text(), re.MULTILINE)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{md.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_the_docs_index_names_every_document():
    index = (DOCS / "README.md").read_text()
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.name != "README.md" and f"]({p.name})" not in index]
    assert missing == []


def _tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    return [ROOT / name for name in out.stdout.decode().split("\0") if name]


def test_no_tracked_file_names_a_work_item_or_session_by_number():
    found = []
    for path in _tracked_text_files():
        rel = path.relative_to(ROOT).as_posix()
        if WORK_REF.search(re.sub(r"[_\-/.]", " ", rel)):
            found.append(f"{rel} (its name)")
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary: images, archives
        try:
            text = data.decode()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if match := WORK_REF.search(line):
                found.append(f"{rel}:{number}: {match.group(0)!r}")
    assert found == [], "state the rule or the fact itself, not its number:\n" + "\n".join(found)
