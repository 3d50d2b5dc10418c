"""Markdown for artifacts: tables whose cells may hold any text."""

from __future__ import annotations

from collections.abc import Sequence


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The table's lines; a `|` or `\\` in a cell is escaped, a line break becomes a space."""

    def cells(values: Sequence[str]) -> str:
        # Backslashes first: a cell's own `\|` must not read as an escaped pipe and lose its
        # backslash (https://github.github.com/gfm/#tables-extension-).
        escaped = (
            " ".join(value.splitlines()).replace("\\", "\\\\").replace("|", "\\|")
            for value in values
        )
        return "| " + " | ".join(escaped) + " |"

    return [cells(header), cells(["---"] * len(header)), *(cells(row) for row in rows)]
