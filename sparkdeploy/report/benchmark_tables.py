"""The tables of a benchmark's artifacts and of a comparison's: a benchmark's figures at each
level (a Prefect table's rows, a markdown table), and the side-by-side table of B against A.
"""

from __future__ import annotations

from collections.abc import Sequence

from sparkdeploy.report.benchmark_figures import (
    FIGURE_BY_NAME,
    FIGURES,
    FigureSpec,
    LevelFigures,
    format_spread,
)
from sparkdeploy.report.markdown import markdown_table
from sparkdeploy.report.verdicts import Row, Verdict


def level_rows(figures: LevelFigures) -> list[dict[str, str]]:
    """One row per level for a Prefect table artifact: each figure as median ± spread."""
    rows = []
    for level, at_level in figures.items():
        row = {"concurrency": str(level)}
        for name, spread in at_level.items():
            row[FIGURE_BY_NAME[name].label] = format_spread(name, spread)
        rows.append(row)
    return rows


def figures_table(
    figures: LevelFigures, specs: Sequence[FigureSpec] = FIGURES, column: str = "c"
) -> list[str]:
    """The markdown table of every figure (a row each) at every level (a column each: c=4),
    or at every context depth (specs DEPTH_FIGURES, column "d": d=8192)."""
    return markdown_table(
        ["figure", *(f"{column}={level}" for level in figures)],
        [
            [
                spec.label,
                *(
                    format_spread(spec.name, at_level.get(spec.name))
                    for at_level in figures.values()
                ),
            ]
            for spec in specs
        ],
    )


def comparison_table(rows: Sequence[Row]) -> list[str]:
    """The side-by-side markdown table: each row's A, B, B − A and its verdict."""
    return markdown_table(
        ["", "figure", "A", "B", "B − A", "verdict"],
        [[r.group, r.figure, r.a, r.b, r.difference, _emphasised(r.verdict)] for r in rows],
    )


def _emphasised(verdict: Verdict) -> str:
    return f"**{verdict}**" if verdict in ("better", "worse") else verdict
