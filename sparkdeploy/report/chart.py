"""Line charts as SVG, for markdown artifacts: figures against concurrency (or context depth), one
panel each.

Written out by hand (no plotting library): a few panels of a few points need none. The picture
goes into a markdown artifact as `![...](data:image/svg+xml;base64,...)`: Prefect's UI shows an
image from a data URI (docs/field.md, "Prefect's UI").
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

PANEL_WIDTH = 300
PANEL_HEIGHT = 220
MARGIN_LEFT = 52
MARGIN_RIGHT = 12
MARGIN_TOP = 28
MARGIN_BOTTOM = 52
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
DASHES = ("", "6 4", "2 3", "8 3 2 3")


@dataclass(frozen=True)
class Point:
    x: int  # the concurrency level, or the context depth
    y: float
    spread: float = 0.0  # drawn as an error bar of ±spread


@dataclass(frozen=True)
class Series:
    name: str
    points: tuple[Point, ...]


@dataclass(frozen=True)
class Panel:
    title: str
    series: tuple[Series, ...]
    x_label: str = "concurrency"


def nice_axis(value: float) -> tuple[float, int]:
    """An axis top at or above value and its number of intervals, each a round step: 1, 2, 4,
    5, 8 or 10 times a power of ten, in 4 or 5 intervals."""
    if value <= 0:
        return 1.0, 4
    power = 10 ** math.floor(math.log10(value))
    top = next(step * power for step in (1, 2, 4, 5, 8, 10) if step * power >= value * 0.999999)
    return top, 5 if round(top / power) == 5 else 4


def _number(value: float) -> str:
    return f"{value:.3g}" if value < 1000 else f"{value:,.0f}"


def _panel(panel: Panel, left: float) -> list[str]:
    levels = sorted({point.x for series in panel.series for point in series.points})
    top, intervals = nice_axis(
        max(
            (point.y + point.spread for series in panel.series for point in series.points),
            default=1.0,
        )
    )
    plot_w = PANEL_WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = PANEL_HEIGHT - MARGIN_TOP - MARGIN_BOTTOM
    x0, y0 = left + MARGIN_LEFT, MARGIN_TOP + plot_h

    def x_of(level: int) -> float:
        if len(levels) == 1:
            return x0 + plot_w / 2
        return x0 + plot_w * levels.index(level) / (len(levels) - 1)

    def y_of(value: float) -> float:
        return y0 - plot_h * max(value, 0.0) / top

    out = [
        f'<text x="{left + PANEL_WIDTH / 2:.1f}" y="16" text-anchor="middle" '
        f'font-weight="bold">{escape(panel.title)}</text>'
    ]
    for tick in range(intervals + 1):
        value = top * tick / intervals
        y = y_of(value)
        out.append(
            f'<line x1="{x0:.1f}" y1="{y:.1f}" x2="{x0 + plot_w:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
        )
        out.append(
            f'<text x="{x0 - 4:.1f}" y="{y + 4:.1f}" text-anchor="end">{_number(value)}</text>'
        )
    out.extend(
        f'<text x="{x_of(level):.1f}" y="{y0 + 16:.1f}" text-anchor="middle">{level}</text>'
        for level in levels
    )
    out.append(
        f'<text x="{x0 + plot_w / 2:.1f}" y="{y0 + 34:.1f}" text-anchor="middle">'
        f"{escape(panel.x_label)}</text>"
    )
    for index, series in enumerate(panel.series):
        colour, dash = COLOURS[index % len(COLOURS)], DASHES[index % len(DASHES)]
        points = sorted(series.points, key=lambda point: point.x)
        path = " ".join(f"{x_of(p.x):.1f},{y_of(p.y):.1f}" for p in points)
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(
            f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dashed}/>'
        )
        for point in points:
            x = x_of(point.x)
            if point.spread > 0:
                low, high = y_of(point.y - point.spread), y_of(point.y + point.spread)
                out.append(
                    f'<line x1="{x:.1f}" y1="{low:.1f}" x2="{x:.1f}" y2="{high:.1f}" '
                    f'stroke="{colour}"/>'
                )
            out.append(f'<circle cx="{x:.1f}" cy="{y_of(point.y):.1f}" r="3" fill="{colour}"/>')
    return out


def svg(panels: Sequence[Panel]) -> str:
    """The panels side by side, a legend of the series below them."""
    names = list(dict.fromkeys(series.name for panel in panels for series in panel.series))
    width = PANEL_WIDTH * max(len(panels), 1)
    height = PANEL_HEIGHT + 8 + 16 * len(names)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    for index, panel in enumerate(panels):
        out += _panel(panel, index * PANEL_WIDTH)
    for index, name in enumerate(names):
        y = PANEL_HEIGHT + 4 + 16 * index
        colour, dash = COLOURS[index % len(COLOURS)], DASHES[index % len(DASHES)]
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(
            f'<line x1="{MARGIN_LEFT}" y1="{y:.1f}" x2="{MARGIN_LEFT + 28}" y2="{y:.1f}" '
            f'stroke="{colour}" stroke-width="2"{dashed}/>'
        )
        out.append(f'<text x="{MARGIN_LEFT + 34}" y="{y + 4:.1f}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def markdown_image(alt: str, picture: str) -> str:
    """A markdown image of an SVG document, inlined as a base64 data URI."""
    encoded = base64.b64encode(picture.encode()).decode()
    return f"![{alt}](data:image/svg+xml;base64,{encoded})"
