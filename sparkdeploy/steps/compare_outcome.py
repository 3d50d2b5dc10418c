"""What one side of a comparison did (sparkdeploy.steps.compare), and the side-by-side rows of
two: every smoke check, each eval of the recipes' [quality] over its repeated runs, every
benchmark figure at every level and context depth, the boot's phases and the head log's figures,
each with B's difference from A and a verdict within noise (sparkdeploy.report.verdicts); and what
the rows say of a ship rule's subjects (sparkdeploy.report.ship_rule).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sparkdeploy.errors import EngineFailure
from sparkdeploy.report.benchmark_figures import (
    DEPTH_FIGURES,
    FIGURE_BY_NAME,
    Better,
    FigureSpec,
    Spread,
)
from sparkdeploy.report.quality import EvalResult, QualityReport, format_value
from sparkdeploy.report.ship_rule import Judged, Subject
from sparkdeploy.report.verdicts import NoiseRule, Row, Verdict, benchmark_rows, single_row
from sparkdeploy.steps.benchmark import BenchmarkResult
from sparkdeploy.steps.smoke_test import SmokeReport
from sparkdeploy.steps.summary import DeploySummary

CAUSE_MAX_CHARS = 400


def failure_cause(error: BaseException) -> str:
    """A failure named for the table: an engine failure's kind, node and cause, else the
    error's type and message on one line (many say where on the first and what on the next)."""
    if isinstance(error, EngineFailure):
        named = (
            error.cause if error.cause.startswith(error.kind) else f"{error.kind}: {error.cause}"
        )
        return f"{named} (on {error.node})"
    text = " ".join(str(error).split())
    if len(text) > CAUSE_MAX_CHARS:
        text = text[: CAUSE_MAX_CHARS - 1] + "…"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@dataclass(frozen=True)
class SideOutcome:
    """What one side's run gave; `failed_at` names the step that failed, if one did."""

    label: str
    summary: DeploySummary | None = None
    smoke: SmokeReport | None = None
    benchmark: BenchmarkResult | None = None
    # The quality gate's report of each repeated run, when the recipe has [quality]: scores
    # below their thresholds are the comparison's findings, not the side's failure.
    quality: tuple[QualityReport, ...] = ()
    failed_at: str | None = None  # deploy, smoke, quality, benchmark, teardown, side
    cause: str | None = None
    flow_run_id: str | None = None  # the side's flow run (set by the compare flow)

    @property
    def ok(self) -> bool:
        return self.failed_at is None

    def state_text(self) -> str:
        if self.ok:
            gated = f"quality gate run {len(self.quality)} times, " if self.quality else ""
            return f"deployed, smoke passed, {gated}benchmarked, torn down"
        return f"FAILED at {self.failed_at}: {self.cause}"


def smoke_failure(report: SmokeReport) -> str:
    return "; ".join(f"{check.name}: {check.evidence}" for check in report.failed)


def _smoke_rows(a: SideOutcome, b: SideOutcome) -> list[Row]:
    checks_a = {check.name: check for check in (a.smoke.checks if a.smoke else [])}
    checks_b = {check.name: check for check in (b.smoke.checks if b.smoke else [])}
    rows = []
    for name in [*checks_a, *(name for name in checks_b if name not in checks_a)]:
        ca, cb = checks_a.get(name), checks_b.get(name)
        text_a = "—" if ca is None else ("pass" if ca.passed else "FAIL")
        text_b = "—" if cb is None else ("pass" if cb.passed else "FAIL")
        verdict: Verdict = "—"
        if ca is not None and cb is not None:
            verdict = "same" if ca.passed == cb.passed else ("better" if cb.passed else "worse")
        rows.append(Row("smoke", name, text_a, text_b, "", verdict))
    return rows


# The head log's figures (sparkdeploy.vllm.markers): which way is better, and whether they are
# timings (noisy) or amounts the configuration fixes.
LOG_FIGURES: dict[str, tuple[str, Better, bool]] = {
    "weights_load_s": ("weights loaded in (s)", "lower", True),
    "model_load_s": ("model loaded in (s)", "lower", True),
    "init_engine_s": ("engine init: profile, KV cache, warm-up (s)", "lower", True),
    "model_load_gib": ("model weights (GiB)", "lower", False),
    "kv_cache_gib": ("KV cache memory (GiB)", "higher", False),
    "kv_cache_tokens": ("KV cache (tokens)", "higher", False),
    "max_concurrency": ("max concurrency at max-model-len (x)", "higher", False),
}


def _union(first: Mapping[str, float], second: Mapping[str, float]) -> list[str]:
    return [*first, *(key for key in second if key not in first)]


def _boot_rows(a: SideOutcome, b: SideOutcome, noise: NoiseRule) -> list[Row]:
    """The boot from the containers' start to ready and its phases (the head's markers on the
    readiness timeline), and the head log's figures. The deploy's other steps (prefetch,
    image, compose) measure the caches of the pipeline, not the recipe: not compared."""
    sa, sb = a.summary, b.summary
    ready = (sa.ready_after_s if sa else None, sb.ready_after_s if sb else None)
    rows = [single_row("boot", "ready after (s)", ready, "lower", True, noise)]
    markers_a = sa.head_markers_s if sa else {}
    markers_b = sb.head_markers_s if sb else {}
    for marker in _union(markers_a, markers_b):
        values = (markers_a.get(marker), markers_b.get(marker))
        rows.append(single_row("boot", f"head: {marker} at (s)", values, "lower", True, noise))
    figures_a = sa.head_figures if sa else {}
    figures_b = sb.head_figures if sb else {}
    for name, (label, better, timing) in LOG_FIGURES.items():
        if name in figures_a or name in figures_b:
            values = (figures_a.get(name), figures_b.get(name))
            rows.append(single_row("log", label, values, better, timing, noise))
    return rows


def _benchmark_rows(a: SideOutcome, b: SideOutcome, noise: NoiseRule) -> list[Row]:
    figures_a = a.benchmark.figures() if a.benchmark else {}
    figures_b = b.benchmark.figures() if b.benchmark else {}
    requests: dict[int, int] = {}  # per level, the fewer of the two sides'
    for side in (a, b):
        for result in side.benchmark.levels if side.benchmark else ():
            count = result.requests_per_run
            requests[result.concurrency] = min(requests.get(result.concurrency, count), count)
    depths_a = a.benchmark.depth_figures() if a.benchmark else {}
    depths_b = b.benchmark.depth_figures() if b.benchmark else {}
    one_each = dict.fromkeys({*depths_a, *depths_b}, 1)  # a depth's run is one request
    return [
        *benchmark_rows(figures_a, figures_b, requests, noise),
        *benchmark_rows(depths_a, depths_b, one_each, noise, specs=DEPTH_FIGURES, group="d"),
    ]


def _scores(reports: Sequence[QualityReport]) -> dict[str, list[EvalResult]]:
    """Each eval's results over the repeated runs, by its name, in the order the runs gave."""
    by_name: dict[str, list[EvalResult]] = {}
    for report in reports:
        for result in report.results:
            by_name.setdefault(result.name, []).append(result)
    return by_name


def _score_spread(results: Sequence[EvalResult]) -> Spread | None:
    scores = [result.score for result in results if result.score is not None]
    return Spread.of(scores) if scores else None


def _score_text(results: Sequence[EvalResult], spread: Spread | None) -> str:
    if not results:
        return "—"
    if spread is None:
        return f"no score: {results[0].error}"
    unit = results[0].unit
    text = format_value(spread.value, unit)
    if spread.spread:
        text += f" ± {format_value(spread.spread, unit)}"
    runs = f" ({len(spread.values)} runs)" if len(spread.values) > 1 else ""
    passed = sum(result.passed for result in results)
    verdict = "pass" if passed == len(results) else f"FAIL {len(results) - passed}/{len(results)}"
    return f"{text}{runs}, {verdict}"


def eval_spec(result: EvalResult) -> FigureSpec:
    """An eval's score as a benchmark figure is judged: a rate, higher better for a min_score,
    lower for a max (the typo rate)."""
    better: Better = "higher" if result.bound == "min" else "lower"
    return FigureSpec(f"eval:{result.name}", result.name, "rate", better)


def _quality_rows(a: SideOutcome, b: SideOutcome, noise: NoiseRule) -> list[Row]:
    """Each eval either side ran: its median score over the repeated runs, judged like a
    benchmark rate (beyond both sides' spreads and the relative floor)."""
    scores_a, scores_b = _scores(a.quality), _scores(b.quality)
    rows = []
    for name in [*scores_a, *(name for name in scores_b if name not in scores_a)]:
        results_a, results_b = scores_a.get(name, []), scores_b.get(name, [])
        spread_a, spread_b = _score_spread(results_a), _score_spread(results_b)
        first = (results_a or results_b)[0]
        figure = f"{name} ({first.threshold_text})"
        shown = _score_text(results_a, spread_a), _score_text(results_b, spread_b)
        if spread_a is None or spread_b is None:
            rows.append(Row("quality", figure, *shown, "", "—"))
            continue
        change = spread_b.value - spread_a.value
        difference = ("+" if change >= 0 else "−") + format_value(abs(change), first.unit)
        verdict = noise.verdict(eval_spec(first), spread_a, spread_b, requests_per_run=0)
        rows.append(Row("quality", figure, *shown, difference, verdict))
    return rows


def side_rows(a: SideOutcome, b: SideOutcome, noise: NoiseRule) -> list[Row]:
    """The side-by-side table: the run's outcome, the smoke checks, the evals, the benchmark,
    the boot."""
    return [
        Row(
            "run",
            "outcome",
            "ok" if a.ok else f"FAILED at {a.failed_at}",
            "ok" if b.ok else f"FAILED at {b.failed_at}",
            "",
            "same" if a.ok == b.ok else ("better" if b.ok else "worse"),
        ),
        *_smoke_rows(a, b),
        *_quality_rows(a, b, noise),
        *_benchmark_rows(a, b, noise),
        *_boot_rows(a, b, noise),
    ]


def _eval_name(subject: Subject, b: SideOutcome) -> str:
    """The eval a rule's subject names: itself, or for `quality` B's only eval."""
    if subject.name != "quality":
        return subject.name
    names = list(_scores(b.quality))
    return names[0] if len(names) == 1 else subject.name


def judge_subject(
    subject: Subject, a: SideOutcome, b: SideOutcome, rows: Sequence[Row]
) -> Judged | str:
    """What the comparison shows of a ship rule's subject, or why it shows nothing."""
    if subject.kind == "eval":
        name = _eval_name(subject, b)
        results = _scores(b.quality).get(name)
        if not results:
            ran = ", ".join(_scores(b.quality)) or "none"
            return f"B ran no eval {name!r} (its evals: {ran}; `quality` names its only one)"
        scored = next(r for r in rows if r.group == "quality" and r.figure.startswith(f"{name} ("))
        spread = _score_spread(results)
        b_score = spread.value if spread else None
        return Judged(b_score, scored.verdict, f"A {scored.a}, B {scored.b}")
    spec = FIGURE_BY_NAME[subject.name]
    group = f"{'c' if subject.kind == 'level' else 'd'}={subject.at}"
    figures = _measured(b, subject.kind)
    value = figures.get(subject.at or 0, {}).get(subject.name)
    row = next((r for r in rows if r.group == group and r.figure == spec.label), None)
    if value is None or row is None:
        where = "concurrency" if subject.kind == "level" else "context depth"
        return f"B measured no {spec.label} at {where} {subject.at}"
    return Judged(value.value * spec.scale, row.verdict, f"A {row.a}, B {row.b}")


def _measured(side: SideOutcome, kind: str) -> Mapping[int, Mapping[str, Spread]]:
    if side.benchmark is None:
        return {}
    return side.benchmark.figures() if kind == "level" else side.benchmark.depth_figures()
