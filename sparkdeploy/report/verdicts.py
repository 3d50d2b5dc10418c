"""B against A in a comparison (sparkdeploy.steps.compare): how big a difference must be to
count (`NoiseRule`), the verdict it gives (better, worse, or same within noise), and the judged
rows of the side-by-side table for the figures measured once per side and for the benchmark's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from sparkdeploy.report.benchmark_figures import (
    FIGURES,
    Better,
    FigureSpec,
    LevelFigures,
    Spread,
    format_spread,
    format_value,
)

Verdict = Literal["better", "worse", "same", "—"]

# A percentile over requests is judged only when at least this many requests of each run lie
# beyond it: below, it is (nearly) the run's slowest request, which says little.
TAIL_MIN_BEYOND = 2


@dataclass(frozen=True)
class NoiseRule:
    """How big a difference must be to count."""

    # Benchmark figures: B/A beyond this share, and beyond both sides' spreads (as ratios).
    relative: float = 0.10
    latency_floor_s: float = 0.002  # timer and scheduling jitter of one request
    count_floor: float = 0.5  # errors, preemptions: a whole one differs
    # One-sample figures (a boot per side): this share, and at least boot_floor_s for seconds.
    single_relative: float = 0.25
    boot_floor_s: float = 1.0
    # Deterministic figures of the log (KV cache tokens, GiB): this share.
    exact_relative: float = 0.01

    def verdict(self, spec: FigureSpec, a: Spread, b: Spread, requests_per_run: int) -> Verdict:
        """B against A. Serving figures vary by factors (a busy host slows everything in
        proportion), so they are compared as ratios: the same when B/A is within both sides'
        spreads (half the range of their runs, as ratios: about two standard deviations of a
        median of three) or within `relative`. Counts, which may be 0, are compared as
        differences."""
        if spec.better is None:
            return "—"
        if spec.request_quantile is not None:
            beyond = requests_per_run * (1 - spec.request_quantile)
            if beyond < TAIL_MIN_BEYOND:
                return "—"
        difference = b.value - a.value
        floor = {"latency": self.latency_floor_s, "count": self.count_floor}.get(spec.kind, 0.0)
        if abs(difference) <= floor:
            return "same"
        values = (*a.values, *b.values)
        if spec.kind == "count" or min(values) <= 0:
            band = max(a.spread + b.spread, self.relative * max(abs(a.value), abs(b.value)))
            return judge(difference, band, spec.better)
        band = max(_log_spread(a) + _log_spread(b), math.log1p(self.relative))
        return judge(math.log(b.value / a.value), band, spec.better)

    def text(self) -> str:
        return (
            f"benchmark figures: median of the repeated runs ± half their range; same when "
            f"B/A is within both sides' spreads taken as ratios or within ±{self.relative:.0%} "
            f"(a difference under {1000 * self.latency_floor_s:g} ms of latency or "
            f"{self.count_floor:g} of a count is the same); a p90/p99 over fewer than "
            f"{TAIL_MIN_BEYOND} requests per run beyond it is shown, not judged. An eval's "
            f"score and the decode at a context depth: the same, over their repeated runs. "
            f"Boot figures "
            f"(one boot per side): same within {self.single_relative:.0%} or "
            f"{self.boot_floor_s:g} s; the log's memory and KV figures within "
            f"{self.exact_relative:.0%}."
        )


def _log_spread(figure: Spread) -> float:
    """Half the range of the runs as a ratio: ln(max/min) / 2."""
    return (math.log(max(figure.values)) - math.log(min(figure.values))) / 2


def judge(difference: float, band: float, better: Better | None) -> Verdict:
    if abs(difference) <= band:
        return "same"
    if better is None:
        return "—"
    improved = difference < 0 if better == "lower" else difference > 0
    return "better" if improved else "worse"


@dataclass(frozen=True)
class Row:
    group: str  # smoke, boot, log, the benchmark level ("c=4") or context depth ("d=8192")
    figure: str
    a: str
    b: str
    difference: str
    verdict: Verdict


def _difference_text(a: float, b: float, show: str) -> str:
    change = f" ({(b - a) / abs(a):+.0%})" if a else ""
    sign = "+" if b >= a else "−"
    return f"{sign}{show}{change}"


def _number(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def single_row(
    group: str,
    label: str,
    values: tuple[float | None, float | None],
    better: Better,
    timing: bool,
    noise: NoiseRule,
) -> Row:
    """A figure measured once per side: a timing within the boot tolerance, an amount the
    configuration fixes within exact_relative."""
    a, b = values
    if a is None or b is None:
        return Row(group, label, _number(a), _number(b), "", "—")
    scale = max(abs(a), abs(b))
    band = (
        max(noise.single_relative * scale, noise.boot_floor_s)
        if timing
        else noise.exact_relative * scale
    )
    difference = _difference_text(a, b, _number(abs(b - a)))
    return Row(group, label, _number(a), _number(b), difference, judge(b - a, band, better))


def benchmark_rows(
    figures_a: LevelFigures,
    figures_b: LevelFigures,
    requests: Mapping[int, int],
    noise: NoiseRule,
    *,
    specs: Sequence[FigureSpec] = FIGURES,
    group: str = "c",
) -> list[Row]:
    """Every judged figure of every level either side measured (group "c": c=4), or of every
    context depth (specs DEPTH_FIGURES, group "d": d=8192); `requests` is, per level, the
    requests per run of the side that ran fewer."""
    rows = []
    for level in sorted({*figures_a, *figures_b}):
        at_a, at_b = figures_a.get(level, {}), figures_b.get(level, {})
        for spec in specs:
            if spec.kind == "info":
                continue  # what happened (tokens, client CPU), not how well: in each run's table
            fa, fb = at_a.get(spec.name), at_b.get(spec.name)
            if fa is None and fb is None:
                continue
            shown = format_spread(spec.name, fa), format_spread(spec.name, fb)
            if fa is None or fb is None:
                rows.append(Row(f"{group}={level}", spec.label, *shown, "", "—"))
                continue
            difference = fb.value - fa.value
            change = _difference_text(fa.value, fb.value, format_value(spec.name, abs(difference)))
            verdict = noise.verdict(spec, fa, fb, requests[level])
            rows.append(Row(f"{group}={level}", spec.label, *shown, change, verdict))
    return rows
