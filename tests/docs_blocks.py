"""The fenced ```bash blocks of README.md and docs/*.md, as the docs tests run them.

Each line of a block is one command (a line ending in a backslash continues on the next; blank lines and
`#` lines are skipped). A block is skipped only when the line just before its opening fence is
`<!-- not tested: REASON -->`, or `<!-- tested by: tests/PATH.py::test_name -->` naming the test that already
runs the same commands (tests/unit/test_docs_blocks.py checks that the test exists); any other block must hold
at least one command, and every command must pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- (?:not tested: (?P<reason>\S.*?)|tested by: (?P<test>tests/\S+\.py::\w+)) -->$")
OPEN, CLOSE = "```bash", "```"


@dataclass(frozen=True)
class Block:
    page: str
    line: int                  # 1-based line of the opening fence
    commands: tuple[str, ...]
    skip_reason: str | None    # the marker's reason: the block is not run
    tested_by: str | None = None   # "tests/x.py::test_y", the test that runs these commands: not run again here


class DocsError(ValueError):
    pass


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks(text: str, page: str = "<text>") -> list[Block]:
    """Every bash block of one page, in order; DocsError for a block without commands and without the
    marker, an unclosed block, or a marker outside a fenced block that no bash block follows."""
    lines = text.splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if MARKER.match(stripped) and not (i + 1 < len(lines) and lines[i + 1].strip() == OPEN):
            raise DocsError(f"{page}:{i + 1}: a 'not tested' or 'tested by' marker must be the line just before a "
                            "```bash fence")
        if not stripped.startswith(CLOSE):
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == CLOSE), None)
        if end is None:
            raise DocsError(f"{page}:{i + 1}: the {stripped} block is not closed")
        if stripped != OPEN:   # another language's block: its lines are neither commands nor markers
            i = end + 1
            continue
        marker = MARKER.match(lines[i - 1].strip()) if i else None
        block = Block(page, i + 1, commands(lines[i + 1:end]), marker["reason"] if marker else None,
                      marker["test"] if marker else None)
        if not block.commands and block.skip_reason is None:
            raise DocsError(f"{page}:{i + 1}: a ```bash block with no command and no 'not tested' marker")
        found.append(block)
        i = end + 1
    return found


def commands(lines: list[str]) -> tuple[str, ...]:
    out: list[str] = []
    pending = ""
    for line in lines:
        text = line.strip()
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        text = pending + text
        pending = ""
        if text.strip() and not text.startswith("#"):
            out.append(text.strip())
    if pending.strip():
        out.append(pending.strip())
    return tuple(out)


def page_blocks(path: Path) -> list[Block]:
    return blocks(path.read_text(), str(path.relative_to(REPO)))
