"""The serving benchmark's figures (sparkdeploy.steps.benchmark), as its artifacts and a
comparison's (sparkdeploy.steps.compare) show and judge them: what each figure is (its label,
unit and which way is better: the sweep's, and the decode at a context depth's), a percentile
over requests, a figure over repeated runs (the median and half the range), their text, and the
chart's panels.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from sparkdeploy.report import chart

Better = Literal["lower", "higher"]


Kind = Literal["latency", "rate", "count", "info"]


@dataclass(frozen=True)
class FigureSpec:
    name: str
    label: str  # for people: what and in which unit
    kind: Kind  # info: says what happened (tokens, client CPU), not how well
    better: Better | None = None
    scale: float = 1.0  # the label's unit per stored unit (seconds shown as ms: 1000)
    # For a percentile over the run's requests: its quantile (a p99 of 30 requests is their
    # maximum, which says little: sparkdeploy.report.verdicts judges it only with enough requests).
    request_quantile: float | None = None


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec("ttft_p50_s", "TTFT p50 (ms)", "latency", "lower", 1000, 0.5),
    FigureSpec("ttft_p90_s", "TTFT p90 (ms)", "latency", "lower", 1000, 0.9),
    FigureSpec("ttft_p99_s", "TTFT p99 (ms)", "latency", "lower", 1000, 0.99),
    FigureSpec("itl_p50_s", "ITL p50 (ms)", "latency", "lower", 1000),
    FigureSpec("itl_p90_s", "ITL p90 (ms)", "latency", "lower", 1000),
    FigureSpec("itl_p99_s", "ITL p99 (ms)", "latency", "lower", 1000),
    FigureSpec("e2e_p50_s", "E2E p50 (s)", "latency", "lower", request_quantile=0.5),
    FigureSpec("e2e_p90_s", "E2E p90 (s)", "latency", "lower", request_quantile=0.9),
    FigureSpec("e2e_p99_s", "E2E p99 (s)", "latency", "lower", request_quantile=0.99),
    FigureSpec("output_tok_s", "output tok/s", "rate", "higher"),
    FigureSpec("requests_s", "requests/s", "rate", "higher"),
    FigureSpec("decode_tok_s_p50", "decode tok/s per request (p50)", "rate", "higher", 1, 0.5),
    FigureSpec("errors", "errors", "count", "lower"),
    FigureSpec("prompt_tokens_mean", "prompt tokens (engine's count)", "info"),
    FigureSpec("engine_generation_tokens", "engine: generation tokens", "info"),
    FigureSpec("engine_ttft_mean_s", "engine: TTFT mean (ms)", "latency", "lower", 1000),
    FigureSpec("engine_preemptions", "engine: preemptions", "count", "lower"),
    FigureSpec("engine_prefix_cache_hit_rate", "engine: prefix-cache hit rate", "info"),
    FigureSpec("client_cpu_ms_per_request", "client CPU per request (ms)", "info"),
    FigureSpec("client_cpu_cores", "client CPU (share of one core)", "info"),
)
# Decode at a context depth (sparkdeploy.steps.benchmark_depth): one request at a time, each
# depth measured `repeats` times, judged by the same rules as a level's figures.
DEPTH_FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec("depth_decode_tok_s", "decode tok/s (one request)", "rate", "higher"),
    FigureSpec("depth_ttft_s", "TTFT, the context's prefill (ms)", "latency", "lower", 1000),
    FigureSpec("depth_errors", "errors", "count", "lower"),
    FigureSpec("depth_context_tokens", "context tokens (engine's count)", "info"),
)
FIGURE_BY_NAME = {spec.name: spec for spec in (*FIGURES, *DEPTH_FIGURES)}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile with linear interpolation (numpy's default, as vllm bench reports)."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Spread:
    """A figure over the runs of a level: the median and half the range."""

    value: float
    spread: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), (max(values) - min(values)) / 2, tuple(values))


# A benchmark's figures: by concurrency level (or by context depth), by figure name.
LevelFigures = Mapping[int, Mapping[str, Spread]]


def format_value(name: str, value: float) -> str:
    spec = FIGURE_BY_NAME.get(name)
    scaled = value * (spec.scale if spec else 1.0)
    if name == "engine_prefix_cache_hit_rate":
        return f"{value:.1%}"
    if scaled == int(scaled) and abs(scaled) < 1e6:
        return f"{scaled:.0f}"
    return f"{scaled:.3g}" if abs(scaled) < 100 else f"{scaled:.0f}"


def format_spread(name: str, spread: Spread | None) -> str:
    if spread is None:
        return "—"
    text = format_value(name, spread.value)
    return text if spread.spread == 0 else f"{text} ± {format_value(name, spread.spread)}"


CHART_FIGURES = (
    ("output tok/s", "output_tok_s"),
    ("TTFT p50 (ms)", "ttft_p50_s"),
    ("E2E p50 (s)", "e2e_p50_s"),
)


def _panel(title: str, name: str, results: Mapping[str, LevelFigures], x_label: str) -> chart.Panel:
    scale = FIGURE_BY_NAME[name].scale
    series = []
    for label, figures_by_x in results.items():
        points = [
            chart.Point(x, spread.value * scale, spread.spread * scale)
            for x, figures in figures_by_x.items()
            if (spread := figures.get(name)) is not None
        ]
        series.append(chart.Series(label, tuple(points)))
    return chart.Panel(title, tuple(series), x_label)


def chart_panels(
    results: Mapping[str, LevelFigures], depths: Mapping[str, LevelFigures] | None = None
) -> list[chart.Panel]:
    """Throughput and latency against concurrency, one series per result's figures; and the
    decode rate against context depth when a result measured depths."""
    panels = [_panel(title, name, results, "concurrency") for title, name in CHART_FIGURES]
    if depths and any(depths.values()):
        panels.append(
            _panel("decode tok/s at depth", "depth_decode_tok_s", depths, "context tokens")
        )
    return panels
