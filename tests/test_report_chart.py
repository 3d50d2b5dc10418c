"""Line charts as SVG (sparkdeploy.report.chart): well-formed XML whatever the names and figures,
points where their figures put them, one legend entry a series, inlined as a data URI."""

from __future__ import annotations

import base64
import math
from xml.etree import ElementTree

import pytest

from sparkdeploy.report.chart import (
    COLOURS,
    DASHES,
    MARGIN_BOTTOM,
    MARGIN_LEFT,
    MARGIN_RIGHT,
    MARGIN_TOP,
    PANEL_HEIGHT,
    PANEL_WIDTH,
    Panel,
    Point,
    Series,
    markdown_image,
    nice_axis,
    svg,
)

NS = "{http://www.w3.org/2000/svg}"
PLOT_H = PANEL_HEIGHT - MARGIN_TOP - MARGIN_BOTTOM
PLOT_W = PANEL_WIDTH - MARGIN_LEFT - MARGIN_RIGHT
BASELINE = MARGIN_TOP + PLOT_H  # where y = 0 is drawn


def parse(picture: str) -> ElementTree.Element:
    root = ElementTree.fromstring(picture)
    assert root.tag == f"{NS}svg"
    return root


def all_of(root: ElementTree.Element, tag: str) -> list[ElementTree.Element]:
    return list(root.iter(f"{NS}{tag}"))


def texts(root: ElementTree.Element) -> list[str]:
    return [element.text or "" for element in all_of(root, "text")]


def coordinates(polyline: ElementTree.Element) -> list[tuple[float, float]]:
    pairs = (pair.split(",") for pair in polyline.attrib["points"].split())
    return [(float(x), float(y)) for x, y in pairs]


def f(element: ElementTree.Element, name: str) -> float:
    return float(element.attrib[name])


def two_sides() -> list[Panel]:
    a = Series("A", (Point(1, 10.0), Point(4, 35.0), Point(2, 20.0)))
    b = Series("B", (Point(1, 12.0), Point(2, 18.0), Point(4, 30.0)))
    latency = (
        Series("A", (Point(1, 0.1), Point(2, 0.2), Point(4, 0.4))),
        Series("B", (Point(1, 0.1), Point(2, 0.3), Point(4, 0.5))),
    )
    return [Panel("output tok/s", (a, b)), Panel("TTFT p50 (ms)", latency)]


def test_the_svg_is_well_formed_and_sized_for_its_panels_and_legend() -> None:
    root = parse(svg(two_sides()))
    width, height = 2 * PANEL_WIDTH, PANEL_HEIGHT + 8 + 16 * 2
    assert (f(root, "width"), f(root, "height")) == (width, height)
    assert root.attrib["viewBox"] == f"0 0 {width} {height}"
    three = tuple(Series(name, (Point(1, 1.0),)) for name in ("A", "B", "C"))
    one_panel = parse(svg([Panel("t", three)]))
    assert (f(one_panel, "width"), f(one_panel, "height")) == (PANEL_WIDTH, PANEL_HEIGHT + 8 + 48)


def test_a_polyline_per_series_and_panel_through_every_point() -> None:
    root = parse(svg(two_sides()))
    lines = all_of(root, "polyline")
    assert len(lines) == 4
    assert [len(coordinates(line)) for line in lines] == [3, 3, 3, 3]
    assert len(all_of(root, "circle")) == 12


def test_points_are_joined_in_order_of_concurrency_whatever_their_given_order() -> None:
    root = parse(svg(two_sides()))
    first = coordinates(all_of(root, "polyline")[0])  # A's points were given as 1, 4, 2
    xs, ys = [x for x, _ in first], [y for _, y in first]
    assert xs == sorted(xs)
    assert ys == sorted(ys, reverse=True)  # 10, 20, 35: higher up the picture, smaller y


def test_levels_are_spaced_evenly_across_the_plot_and_labelled() -> None:
    root = parse(svg(two_sides()))
    first = coordinates(all_of(root, "polyline")[0])
    assert [x for x, _ in first] == pytest.approx(
        [MARGIN_LEFT, MARGIN_LEFT + PLOT_W / 2, MARGIN_LEFT + PLOT_W]
    )
    second_panel = coordinates(all_of(root, "polyline")[2])
    assert second_panel[0][0] == pytest.approx(PANEL_WIDTH + MARGIN_LEFT)
    assert texts(root).count("1") == 2
    assert texts(root).count("4") == 2
    assert texts(root).count("concurrency") == 2


def test_a_single_level_is_drawn_in_the_middle_of_the_plot() -> None:
    root = parse(svg([Panel("t", (Series("A", (Point(8, 5.0),)),))]))
    (circle,) = all_of(root, "circle")
    assert f(circle, "cx") == pytest.approx(MARGIN_LEFT + PLOT_W / 2)
    assert "8" in texts(root)


def test_the_y_axis_runs_from_zero_to_a_round_top_above_the_highest_point() -> None:
    panel = Panel("tok/s", (Series("A", (Point(1, 120.0), Point(2, 450.0))),))
    root = parse(svg([panel]))
    top, intervals = nice_axis(450.0)
    assert (top, intervals) == (500, 5)
    assert [t for t in texts(root) if t in {"0", "100", "200", "300", "400", "500"}] == [
        "0",
        "100",
        "200",
        "300",
        "400",
        "500",
    ]
    circles = all_of(root, "circle")
    assert f(circles[1], "cy") == pytest.approx(BASELINE - PLOT_H * 450 / 500, abs=0.05)
    assert f(circles[0], "cy") == pytest.approx(BASELINE - PLOT_H * 120 / 500, abs=0.05)


def test_the_axis_top_leaves_room_for_the_error_bar() -> None:
    panel = Panel("e2e", (Series("A", (Point(1, 90.0, spread=30.0),)),))
    root = parse(svg([panel]))
    assert "200" in texts(root)  # 90 + 30 = 120 needs a top of 200, 90 alone 100
    assert "100" in texts(root)


def test_a_spread_is_drawn_as_a_vertical_bar_of_plus_and_minus_it() -> None:
    panel = Panel("t", (Series("A", (Point(1, 50.0, spread=10.0), Point(2, 60.0))),))
    root = parse(svg([panel]))
    bars = [
        line
        for line in all_of(root, "line")
        if line.attrib["x1"] == line.attrib["x2"] and line.attrib["stroke"] == COLOURS[0]
    ]
    assert len(bars) == 1  # the point without a spread has none
    (bar,) = bars
    low, high = sorted((f(bar, "y1"), f(bar, "y2")))
    top = nice_axis(60.0)[0]
    assert high == pytest.approx(BASELINE - PLOT_H * 40 / top, abs=0.05)
    assert low == pytest.approx(BASELINE - PLOT_H * 60 / top, abs=0.05)


def test_negative_figures_are_drawn_on_the_baseline_not_below_the_plot() -> None:
    panel = Panel("delta", (Series("A", (Point(1, -5.0), Point(2, 3.0))),))
    root = parse(svg([panel]))
    assert f(all_of(root, "circle")[0], "cy") == pytest.approx(BASELINE)


def test_names_and_titles_with_markup_characters_are_escaped() -> None:
    name, title = 'A <with> & "quotes"', "p50 < p99 & more"
    root = parse(svg([Panel(title, (Series(name, (Point(1, 1.0),)),))]))
    assert title in texts(root)
    assert name in texts(root)


def test_each_series_is_in_the_legend_once_in_the_colour_and_dash_of_its_line() -> None:
    root = parse(svg(two_sides()))
    legend = [t for t in all_of(root, "text") if t.text in {"A", "B"}]
    assert [t.text for t in legend] == ["A", "B"]
    legend_lines = [line for line in all_of(root, "line") if f(line, "y1") > PANEL_HEIGHT]
    assert [line.attrib["stroke"] for line in legend_lines] == list(COLOURS[:2])
    assert [line.attrib.get("stroke-dasharray", "") for line in legend_lines] == list(DASHES[:2])
    polylines = all_of(root, "polyline")
    assert [p.attrib["stroke"] for p in polylines] == [COLOURS[0], COLOURS[1]] * 2
    assert polylines[1].attrib["stroke-dasharray"] == DASHES[1]
    assert "stroke-dasharray" not in polylines[0].attrib


def test_more_series_than_colours_reuse_them_in_turn() -> None:
    series = tuple(Series(f"s{i}", (Point(1, float(i)),)) for i in range(len(COLOURS) + 1))
    root = parse(svg([Panel("many", series)]))
    strokes = [p.attrib["stroke"] for p in all_of(root, "polyline")]
    assert strokes == [*COLOURS, COLOURS[0]]


def test_no_panels_or_empty_panels_still_make_a_well_formed_picture() -> None:
    nothing = parse(svg([]))
    assert f(nothing, "width") == PANEL_WIDTH
    assert all_of(nothing, "polyline") == []
    empty = parse(svg([Panel("no data", ()), Panel("no points", (Series("A", ()),))]))
    assert "no data" in texts(empty)
    assert "no points" in texts(empty)
    assert [p.attrib["points"] for p in all_of(empty, "polyline")] == [""]
    assert texts(empty).count("1") == 2  # an empty axis runs 0 to 1


def test_huge_and_tiny_figures_are_labelled_readably() -> None:
    huge = parse(svg([Panel("bytes", (Series("A", (Point(1, 2.5e9),)),))]))
    assert "4,000,000,000" in texts(huge)
    tiny = parse(svg([Panel("s", (Series("A", (Point(1, 0.003),)),))]))
    assert {"0.001", "0.002", "0.003", "0.004"} <= set(texts(tiny))


@pytest.mark.parametrize(
    ("value", "axis"),
    [
        (1.0, (1, 4)),
        (1.5, (2, 4)),
        (3.0, (4, 4)),
        (4.5, (5, 5)),
        (6.0, (8, 4)),
        (9.0, (10, 4)),
        (100.0, (100, 4)),
        (101.0, (200, 4)),
        (0.3, (0.4, 4)),
        (0.05, (0.05, 5)),
        (7e9, (8e9, 4)),
    ],
)
def test_the_axis_top_is_the_next_round_figure(value: float, axis: tuple[float, int]) -> None:
    top, intervals = nice_axis(value)
    assert top == pytest.approx(axis[0])
    assert intervals == axis[1]


@pytest.mark.parametrize("value", [0.0, -3.0])
def test_an_axis_for_nothing_positive_is_zero_to_one(value: float) -> None:
    assert nice_axis(value) == (1.0, 4)


def test_every_axis_top_is_round_and_at_most_twice_the_value() -> None:
    for exponent in range(-4, 10):
        for mantissa in (1.0, 1.01, 1.99, 2.0, 2.01, 3.3, 4.0, 4.01, 5.0, 5.5, 7.9, 8.01, 9.99):
            value = mantissa * 10.0**exponent
            top, intervals = nice_axis(value)
            power = 10 ** math.floor(math.log10(value))
            assert value * 0.999999 <= top <= 2 * value * 1.000001, (value, top)
            step = round(top / power)
            assert step in (1, 2, 4, 5, 8, 10), (value, top)
            assert intervals == (5 if step == 5 else 4), (value, top, intervals)


def test_the_markdown_image_inlines_the_svg_as_base64() -> None:
    picture = svg([Panel("tok/s ± spread — A", (Series("Ä", (Point(1, 1.0),)),))])
    image = markdown_image("throughput against concurrency", picture)
    prefix = "![throughput against concurrency](data:image/svg+xml;base64,"
    assert image.startswith(prefix)
    assert image.endswith(")")
    encoded = image[len(prefix) : -1]
    assert base64.b64decode(encoded, validate=True).decode() == picture
    assert "\n" not in image
