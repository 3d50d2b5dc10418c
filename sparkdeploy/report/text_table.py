"""A table for a terminal: columns side by side, the widest wrapped so the table fits."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from itertools import zip_longest

GAP = "  "
# A column is never wrapped narrower than this, nor than its longest word up to MAX_WORD (a
# deployment id, say): below it, a cell reads as a column of fragments, and the terminal may as
# well wrap the line.
MIN_WIDTH = 10
MAX_WORD = 40


def _widths(natural: Sequence[int], floors: Sequence[int], room: int) -> list[int]:
    """Each column's width: its natural one, the widest cut down to one cap until the table
    fits `room` (or every column is at its floor)."""
    if sum(natural) <= room:
        return list(natural)
    cap = max(natural)
    while cap > 1 and sum(min(n, max(cap, f)) for n, f in zip(natural, floors, strict=True)) > room:
        cap -= 1
    return [min(n, max(cap, f)) for n, f in zip(natural, floors, strict=True)]


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], width: int) -> list[str]:
    """The table's lines, at most `width` characters wide where its columns can be wrapped to
    fit; a header, a rule, then each row (its cells wrapped at spaces, a long word cut)."""
    columns = list(zip(header, *rows, strict=True))
    natural = [max(len(cell) for cell in column) for column in columns]
    words = [max(len(word) for cell in column for word in cell.split()) for column in columns]
    floors = [
        min(n, max(MIN_WIDTH, min(word, MAX_WORD))) for n, word in zip(natural, words, strict=True)
    ]
    widths = _widths(natural, floors, width - len(GAP) * (len(header) - 1))

    def lines(cells: Sequence[str]) -> list[str]:
        wrapped = [
            textwrap.wrap(cell, w, break_on_hyphens=False) or [""]
            for cell, w in zip(cells, widths, strict=True)
        ]
        return [
            GAP.join(part.ljust(w) for part, w in zip(parts, widths, strict=True)).rstrip()
            for parts in zip_longest(*wrapped, fillvalue="")
        ]

    rule = GAP.join("-" * w for w in widths)
    return [*lines(header), rule, *(line for row in rows for line in lines(row))]
