"""Markdown tables for artifacts (sparkdeploy.report.markdown): whatever text a cell holds, the
table keeps its shape, one line a row and as many cells a row as the header has."""

from __future__ import annotations

import re

import pytest

from sparkdeploy.report.markdown import markdown_table

# Backslash escapes of ASCII punctuation, as CommonMark reads them inside a cell.
_PUNCTUATION_ESCAPE = re.compile(r"\\([!-/:-@\[-`{-~])")


def cells_of(line: str) -> list[str]:
    """A row's cells as GitHub's renderer (cmark-gfm) reads them: a backslash and the character
    after it are one unit, an unpaired `|` ends a cell; then `\\|` is a pipe and the cell's
    backslash escapes are read."""
    assert line.startswith("| "), line
    assert line.endswith(" |"), line
    cells, cell, rest = [], "", line[2:-2]
    while rest:
        if rest[0] == "\\" and len(rest) > 1:
            cell, rest = cell + rest[:2], rest[2:]
        elif rest[0] == "|":
            cells.append(cell)
            cell, rest = "", rest[1:]
        else:
            cell, rest = cell + rest[0], rest[1:]
    cells.append(cell)
    return [_PUNCTUATION_ESCAPE.sub(r"\1", c.strip().replace("\\|", "|")) for c in cells]


def test_a_table_is_its_header_a_separator_and_a_line_per_row() -> None:
    assert markdown_table(["node", "rank"], [["dgx1", "0"], ["dgx2", "1"]]) == [
        "| node | rank |",
        "| --- | --- |",
        "| dgx1 | 0 |",
        "| dgx2 | 1 |",
    ]


def test_a_table_without_rows_is_its_header_and_separator() -> None:
    assert markdown_table(["figure", "A", "B"], []) == [
        "| figure | A | B |",
        "| --- | --- | --- |",
    ]


def test_the_separator_has_a_cell_for_every_header_cell() -> None:
    header = ["", "figure", "A", "B", "B − A", "verdict"]
    separator = markdown_table(header, [])[1]
    assert cells_of(separator) == ["---"] * len(header)


def test_empty_cells_are_kept_in_place() -> None:
    lines = markdown_table(["", "A", "B"], [["", "x", ""]])
    assert cells_of(lines[0]) == ["", "A", "B"]
    assert cells_of(lines[2]) == ["", "x", ""]


def test_a_pipe_in_a_cell_is_escaped_and_does_not_split_it() -> None:
    lines = markdown_table(["flag", "value"], [["--x", "a|b"], ["||", "| lead and trail |"]])
    assert lines[2] == "| --x | a\\|b |"
    assert cells_of(lines[2]) == ["--x", "a|b"]
    assert cells_of(lines[3]) == ["||", "| lead and trail |"]


def test_a_backslash_in_a_cell_is_kept_before_a_pipe_and_at_the_end() -> None:
    values = ["a\\|b", "C:\\dir\\", "\\\\|", "x\\"]
    lines = markdown_table(["value", "end"], [values[:2], values[2:]])
    assert cells_of(lines[2]) == values[:2]
    assert cells_of(lines[3]) == values[2:]


def test_a_pipe_in_the_header_is_escaped_too() -> None:
    lines = markdown_table(["a|b", "c"], [["1", "2"]])
    assert cells_of(lines[0]) == ["a|b", "c"]
    assert cells_of(lines[1]) == ["---", "---"]


def test_a_line_break_in_a_cell_becomes_a_space_and_the_row_one_line() -> None:
    lines = markdown_table(["error"], [["Traceback:\n  File x\nRuntimeError: boom"], ["a\n\nb"]])
    assert len(lines) == 4
    assert not any("\n" in line for line in lines)
    assert cells_of(lines[2]) == ["Traceback:   File x RuntimeError: boom"]
    assert cells_of(lines[3]) == ["a  b"]


@pytest.mark.parametrize(
    "value",
    [
        "plain",
        "",
        "a|b|c",
        "|",
        "x\ny",
        "\n",
        "line one\nhas | a pipe\n",
        '{"json": ["a", "b|c"]}',
        "`code | span`",
        "9,999 tok/s ± 3 %",
    ],
)
def test_any_cell_text_keeps_the_row_shape(value: str) -> None:
    lines = markdown_table(["key", "value", "note"], [["k", value, "n"]])
    assert len(lines) == 3
    cells = cells_of(lines[2])
    assert cells == ["k", value.replace("\n", " ").strip(), "n"]


def test_a_carriage_return_in_a_cell_does_not_end_the_row() -> None:
    lines = markdown_table(["error"], [["docker logs line\r\nnext line"]])
    assert not any("\r" in line for line in lines)
