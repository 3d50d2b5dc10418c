"""The A/B comparison: two sides deployed, smoke-tested, benchmarked, torn down, side by side.

A side is a recipe, or a recipe with flags, env or image overridden (written out as a variant
recipe: sparkdeploy.spec.recipe_variant). The sides run one after the other on shared nodes (A torn
down before B deploys) or at once on disjoint nodes (`place_sides`). The result is one table:
every smoke check, every benchmark figure at every level, the boot's phases and the figures the
head's log gave, each with B's difference from A and a verdict: better, worse, or same within
noise. A figure of the benchmark is the median of its repeated runs; B/A counts when it is
beyond both sides' spreads (half the range of their runs, as ratios) and beyond a floor
(`NoiseRule.verdict`). A boot happens once per side, so its figures get a fixed tolerance
instead, which the table states. A side that fails (deploy, boot, smoke, benchmark) is shown
failed with its cause; the other side's figures are still there.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sparkdeploy.errors import CompareError, EngineFailure
from sparkdeploy.report import chart
from sparkdeploy.report.markdown import markdown_table
from sparkdeploy.report.recipe_diff import RecipeDiff, diff_recipes
from sparkdeploy.secrecy import MASK
from sparkdeploy.spec.cluster import Cluster
from sparkdeploy.spec.plan import make_plan
from sparkdeploy.spec.project import find_recipe
from sparkdeploy.spec.recipe import Recipe, load_recipe
from sparkdeploy.spec.recipe_variant import recipe_at_revision, write_variant
from sparkdeploy.steps.benchmark import (
    FIGURES,
    BenchmarkResult,
    Better,
    FigureSpec,
    Spread,
    chart_panels,
    format_spread,
    format_value,
)
from sparkdeploy.steps.smoke_test import SmokeReport
from sparkdeploy.steps.summary import DeploySummary

Placement = Literal["auto", "sequential", "at_once"]
Verdict = Literal["better", "worse", "same", "—"]


class CompareSide(BaseModel):
    """One side of a comparison (the Prefect UI's form shows these descriptions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    recipe: str = Field(description="A recipe name under recipes/ (or a path to one).")
    revision: str | None = Field(
        default=None,
        description="A git commit, tag or branch of the project: the recipe as committed there "
        "(default: the recipe as it is now), e.g. the side before a change.",
    )
    args: list[str] = Field(
        default=[],
        description="vLLM flags that replace the recipe's own or are added, as an argv: "
        '["--max-num-seqs", "4", "--enable-prefix-caching"]. A --no-x replaces --x.',
    )
    drop_args: list[str] = Field(
        default=[], description='Flags of the recipe left out, e.g. ["--enforce-eager"].'
    )
    env: dict[str, str] = Field(
        default={}, description="Environment variables set over the recipe's [env]."
    )
    docker_image: str | None = Field(
        default=None, description="Another image for the recipe (a rebuilt one, a new tag)."
    )
    nodes: list[str] | None = Field(
        default=None,
        description="The side's nodes in rank order (default: chosen by placement).",
    )

    @property
    def has_overrides(self) -> bool:
        return bool(self.args or self.drop_args or self.env or self.docker_image)

    def describe(self, recipe: Recipe) -> str:
        """The recipe and the overrides, for people; a secret env value as ***."""
        parts = []
        if self.args:
            parts.append("args " + " ".join(self.args))
        if self.drop_args:
            parts.append("without " + " ".join(self.drop_args))
        if self.env:
            shown = (
                f"{key}={MASK if recipe.is_secret_env(key) else value}"
                for key, value in self.env.items()
            )
            parts.append("env " + " ".join(shown))
        if self.docker_image:
            parts.append(f"image {self.docker_image}")
        at = f" at {self.revision}" if self.revision else ""
        return self.recipe + at + (f" with {'; '.join(parts)}" if parts else "")


@dataclass(frozen=True)
class PreparedSide:
    label: str  # "A" or "B"
    recipe: str  # what the deploy flow takes: the recipe's name, or the variant's path
    recipe_id: str
    description: str
    nodes: list[str]
    deployment_id: str


@dataclass(frozen=True)
class PreparedComparison:
    a: PreparedSide
    b: PreparedSide
    at_once: bool
    placement: str  # how the sides are placed, in words
    diff: RecipeDiff

    @property
    def sides(self) -> tuple[PreparedSide, PreparedSide]:
        return self.a, self.b


def place_sides(
    cluster: Cluster,
    required: tuple[int, int],
    given: tuple[list[str] | None, list[str] | None],
    placement: Placement,
) -> tuple[list[str], list[str], bool, str]:
    """The sides' nodes and whether they run at once: on disjoint nodes when asked to
    (`at_once`) or when the cluster has room (`auto`), else one after the other on the
    first nodes."""
    names = [node.name for node in cluster.nodes]

    def first_free(count: int, taken: Sequence[str]) -> list[str] | None:
        free = [name for name in names if name not in taken]
        return free[:count] if len(free) >= count else None

    if placement != "sequential":
        nodes_a = given[0] or first_free(required[0], given[1] or [])
        nodes_b = given[1] or (first_free(required[1], nodes_a) if nodes_a else None)
        if nodes_a and nodes_b and not set(nodes_a) & set(nodes_b):
            return nodes_a, nodes_b, True, "at once on disjoint nodes"
        if placement == "at_once":
            raise CompareError(
                f"the sides cannot run at once on cluster {cluster.name}: they need "
                f"{required[0]} + {required[1]} nodes"
                + (
                    f" and share {', '.join(sorted(set(nodes_a) & set(nodes_b)))}"
                    if nodes_a and nodes_b
                    else f", the cluster has {len(names)}"
                )
                + '; name disjoint nodes for each side or use placement "sequential"'
            )
    nodes_a = given[0] or names[: required[0]]
    nodes_b = given[1] or names[: required[1]]
    return nodes_a, nodes_b, False, "one after the other (A torn down before B deploys)"


def prepare(
    side_a: CompareSide,
    side_b: CompareSide,
    cluster: Cluster,
    placement: Placement,
    *,
    variants: Path,
    root: Path | None = None,
) -> PreparedComparison:
    """Both sides' recipes loaded (variants written and checked), their nodes placed and
    planned: every input problem is found here, before anything is deployed."""
    loaded = []
    for label, side in (("A", side_a), ("B", side_b)):
        what = f"side {label}"
        path = find_recipe(side.recipe, root)
        argument = side.recipe
        if side.revision:
            path = recipe_at_revision(path, side.revision, variants, what=what)
            argument = str(path.parent)
        base = load_recipe(path)
        recipe = base
        if side.has_overrides:
            path = write_variant(
                base,
                variants,
                args=side.args,
                drop_args=side.drop_args,
                env=side.env,
                docker_image=side.docker_image,
                what=what,
            )
            argument, recipe = str(path.parent), load_recipe(path)
        loaded.append((label, side, argument, recipe, side.describe(base)))
    (_, _, _, recipe_a, _), (_, _, _, recipe_b, _) = loaded
    nodes_a, nodes_b, at_once, how = place_sides(
        cluster,
        (recipe_a.required_nodes, recipe_b.required_nodes),
        (side_a.nodes, side_b.nodes),
        placement,
    )
    a, b = (
        PreparedSide(
            label,
            argument,
            recipe.recipe_id,
            description,
            nodes,
            make_plan(recipe, cluster, nodes).deployment_id,
        )
        for (label, _, argument, recipe, description), nodes in zip(
            loaded, (nodes_a, nodes_b), strict=True
        )
    )
    diff = diff_recipes(
        recipe_a, recipe_b, a_name=f"A: {a.description}", b_name=f"B: {b.description}"
    )
    return PreparedComparison(a, b, at_once, how, diff)


# ---------------------------------------------------------------------------------------------
# What a side did


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
    failed_at: str | None = None  # deploy, smoke, benchmark, teardown, side
    cause: str | None = None
    flow_run_id: str | None = None  # the side's flow run (set by the compare flow)

    @property
    def ok(self) -> bool:
        return self.failed_at is None

    def state_text(self) -> str:
        if self.ok:
            return "deployed, smoke passed, benchmarked, torn down"
        return f"FAILED at {self.failed_at}: {self.cause}"


def smoke_failure(report: SmokeReport) -> str:
    return "; ".join(f"{check.name}: {check.evidence}" for check in report.failed)


# ---------------------------------------------------------------------------------------------
# Verdicts


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
            f"{TAIL_MIN_BEYOND} requests per run beyond it is shown, not judged. Boot figures "
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
    group: str  # smoke, boot, log, or the benchmark level ("c=4")
    figure: str
    a: str
    b: str
    difference: str
    verdict: Verdict


def _difference_text(a: float, b: float, show: str) -> str:
    change = f" ({(b - a) / abs(a):+.0%})" if a else ""
    sign = "+" if b >= a else "−"
    return f"{sign}{show}{change}"


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


def _number(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def _single_row(
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


def _union(first: Mapping[str, float], second: Mapping[str, float]) -> list[str]:
    return [*first, *(key for key in second if key not in first)]


def _boot_rows(a: SideOutcome, b: SideOutcome, noise: NoiseRule) -> list[Row]:
    """The boot from the containers' start to ready and its phases (the head's markers on the
    readiness timeline), and the head log's figures. The deploy's other steps (prefetch,
    image, compose) measure the caches of the pipeline, not the recipe: not compared."""
    sa, sb = a.summary, b.summary
    ready = (sa.ready_after_s if sa else None, sb.ready_after_s if sb else None)
    rows = [_single_row("boot", "ready after (s)", ready, "lower", True, noise)]
    markers_a = sa.head_markers_s if sa else {}
    markers_b = sb.head_markers_s if sb else {}
    for marker in _union(markers_a, markers_b):
        values = (markers_a.get(marker), markers_b.get(marker))
        rows.append(_single_row("boot", f"head: {marker} at (s)", values, "lower", True, noise))
    figures_a = sa.head_figures if sa else {}
    figures_b = sb.head_figures if sb else {}
    for name, (label, better, timing) in LOG_FIGURES.items():
        if name in figures_a or name in figures_b:
            values = (figures_a.get(name), figures_b.get(name))
            rows.append(_single_row("log", label, values, better, timing, noise))
    return rows


def _benchmark_rows(a: SideOutcome, b: SideOutcome, noise: NoiseRule) -> list[Row]:
    figures_a = a.benchmark.figures() if a.benchmark else {}
    figures_b = b.benchmark.figures() if b.benchmark else {}
    requests: dict[int, int] = {}  # per level, the fewer of the two sides'
    for side in (a, b):
        for result in side.benchmark.levels if side.benchmark else ():
            count = result.requests_per_run
            requests[result.concurrency] = min(requests.get(result.concurrency, count), count)
    rows = []
    for level in sorted({*figures_a, *figures_b}):
        at_a, at_b = figures_a.get(level, {}), figures_b.get(level, {})
        for spec in FIGURES:
            if spec.kind == "info":
                continue  # what happened (tokens, client CPU), not how well: in each run's table
            fa, fb = at_a.get(spec.name), at_b.get(spec.name)
            if fa is None and fb is None:
                continue
            shown = format_spread(spec.name, fa), format_spread(spec.name, fb)
            if fa is None or fb is None:
                rows.append(Row(f"c={level}", spec.label, *shown, "", "—"))
                continue
            difference = fb.value - fa.value
            change = _difference_text(fa.value, fb.value, format_value(spec.name, abs(difference)))
            verdict = noise.verdict(spec, fa, fb, requests[level])
            rows.append(Row(f"c={level}", spec.label, *shown, change, verdict))
    return rows


@dataclass(frozen=True)
class Comparison:
    prepared: PreparedComparison
    a: SideOutcome
    b: SideOutcome
    rows: tuple[Row, ...]
    noise: NoiseRule = field(default_factory=NoiseRule)

    @classmethod
    def of(
        cls, prepared: PreparedComparison, a: SideOutcome, b: SideOutcome, noise: NoiseRule
    ) -> Comparison:
        rows = [
            Row(
                "run",
                "outcome",
                "ok" if a.ok else f"FAILED at {a.failed_at}",
                "ok" if b.ok else f"FAILED at {b.failed_at}",
                "",
                "same" if a.ok == b.ok else ("better" if b.ok else "worse"),
            ),
            *_smoke_rows(a, b),
            *_benchmark_rows(a, b, noise),
            *_boot_rows(a, b, noise),
        ]
        return cls(prepared, a, b, tuple(rows), noise)

    def verdicts(self) -> Counter[str]:
        return Counter(row.verdict for row in self.rows)

    def row(self, group: str, figure: str) -> Row:
        return next(row for row in self.rows if row.group == group and row.figure == figure)

    @property
    def failed(self) -> list[SideOutcome]:
        return [side for side in (self.a, self.b) if not side.ok]

    def summary_line(self) -> str:
        counts = self.verdicts()
        judged = ", ".join(f"{counts[v]} {v}" for v in ("better", "worse", "same") if counts[v])
        failed = "; ".join(f"side {side.label} {side.state_text()}" for side in self.failed)
        return f"B against A: {judged or 'nothing judged'}" + (f". {failed}" if failed else "")

    def markdown(self, links: Mapping[str, str] | None = None) -> str:
        links = links or {}
        prepared = self.prepared
        title = f"# Compare A: {prepared.a.description} with B: {prepared.b.description}"
        sides = [
            ["recipe", f"`{prepared.a.recipe_id}`", f"`{prepared.b.recipe_id}`"],
            ["nodes", ", ".join(prepared.a.nodes), ", ".join(prepared.b.nodes)],
            ["deployment", f"`{prepared.a.deployment_id}`", f"`{prepared.b.deployment_id}`"],
            ["run", *(self._link(side, links) for side in (self.a, self.b))],
            ["outcome", self.a.state_text(), self.b.state_text()],
        ]
        lines = [
            title,
            "",
            "## What differs, as the engine sees it",
            "",
            prepared.diff.markdown(),
            "",
            f"Placement: {prepared.placement}.",
            "",
            *markdown_table(["", "A", "B"], sides),
        ]
        results = {
            f"{side.label}: {side_prepared.description}": side.benchmark
            for side, side_prepared in ((self.a, prepared.a), (self.b, prepared.b))
            if side.benchmark is not None
        }
        if results:
            lines += [
                "",
                chart.markdown_image(
                    "throughput and latency against concurrency, A and B",
                    chart.svg(chart_panels(results)),
                ),
            ]
        lines += [
            "",
            f"## Side by side: {self.summary_line()}",
            "",
            *markdown_table(
                ["", "figure", "A", "B", "B − A", "verdict"],
                [
                    [r.group, r.figure, r.a, r.b, r.difference, _emphasised(r.verdict)]
                    for r in self.rows
                ],
            ),
            "",
            f"Noise: {self.noise.text()}",
        ]
        for side in (self.a, self.b):
            if side.benchmark is not None:
                prompt = side.benchmark.prompt
                lines.append(
                    f"- {side.label}: prompts of {prompt.counted} tokens as its engine counts "
                    f"them; {side.benchmark.client_check.text()}."
                )
                notes = side.benchmark.engine_disagreements()
                lines += [f"- {side.label}: {note}" for note in notes]
        return "\n".join(lines)

    @staticmethod
    def _link(side: SideOutcome, links: Mapping[str, str]) -> str:
        if side.label in links:
            return f"[side {side.label}]({links[side.label]})"
        return side.flow_run_id or "—"


def _emphasised(verdict: Verdict) -> str:
    return f"**{verdict}**" if verdict in ("better", "worse") else verdict
