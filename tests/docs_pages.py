"""Reading the project's pages (README.md and docs/*.md) for the docs check:
fenced blocks with their ``<!-- docs-check: ... -->`` markers, relative links,
heading anchors, and the commands of ``bash`` blocks.

Standard library only: CI runs it before anything is installed, to run the
README's quick-start commands exactly as written:

    python3 tests/docs_pages.py quickstart N    # prints the README's N-th quick-start command
"""

from __future__ import annotations

import pathlib
import re
import shlex
import sys
from typing import Iterator, NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!--\s*docs-check:\s*(.+?)\s*-->$")
LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)\)")


def pages() -> list[pathlib.Path]:
    """README.md and every page of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


class Block(NamedTuple):
    """A fenced block of a page."""

    page: pathlib.Path
    line: int  # of its opening fence, 1-based
    lang: str
    text: str
    marker: str  # the ``docs-check`` marker on the line before it ("" if none)
    section: str  # the heading it sits under


def blocks(page: pathlib.Path) -> list[Block]:
    """The fenced blocks of ``page``, in order."""
    found, lines = [], page.read_text(encoding="utf-8").splitlines()
    i, section, previous = 0, "", ""
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("#") and not stripped.startswith("#!"):
            section = stripped.lstrip("#").strip()
        if stripped.startswith("```"):
            indent = len(lines[i]) - len(lines[i].lstrip())
            lang, start, body = stripped[3:].strip(), i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                line = lines[i]
                body.append(line[indent:] if not indent or line[:indent].isspace() else line.lstrip())
                i += 1
            match = MARKER.match(previous)
            found.append(Block(page, start, lang, "\n".join(body) + "\n", match.group(1) if match else "", section))
            previous = ""
        elif stripped:
            previous = stripped
        i += 1
    return found


def prose(page: pathlib.Path) -> str:
    """The page without its fenced blocks and inline code (where links are not links)."""
    text = re.sub(r"^\s*```.*?^\s*```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def links(page: pathlib.Path) -> list[str]:
    """Every link and image target of ``page`` outside code."""
    return [m.group(2) for m in LINK.finditer(prose(page))]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    """The anchors of every heading of ``page`` (outside code)."""
    return {anchor(line.lstrip("#")) for line in prose(page).splitlines() if re.match(r"^#{1,6} ", line)}


class Command(NamedTuple):
    """A command shown in a ``bash`` block (continuation lines joined, comments dropped)."""

    block: Block
    text: str  # as shown
    env: dict  # leading VAR=value assignments
    argv: list  # the rest, split as the shell would

    @property
    def where(self) -> str:
        return f"{self.block.page.relative_to(ROOT)}:{self.block.line}"


def commands(block: Block) -> Iterator[Command]:
    """The commands of a ``bash`` block."""
    logical = ""
    for line in block.text.splitlines():
        logical += line.rstrip().removesuffix("\\") + (" " if line.rstrip().endswith("\\") else "")
        if line.rstrip().endswith("\\"):
            continue
        tokens = shlex.split(logical, comments=True)
        text, logical = " ".join(logical.split(" #")[0].split()), ""
        if not tokens:
            continue
        env = {}
        while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
            key, _, value = tokens.pop(0).partition("=")
            env[key] = value
        yield Command(block, text, env, tokens)


def quickstart() -> list[str]:
    """The README's quick-start commands: the ``bash`` blocks under "Quick start"."""
    return [command.text for block in blocks(ROOT / "README.md")
            if block.section == "Quick start" and block.lang == "bash" for command in commands(block)]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "quickstart":
        print(quickstart()[int(sys.argv[2]) - 1])
    else:
        sys.exit(f"usage: {sys.argv[0]} quickstart N")
