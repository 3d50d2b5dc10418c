"""The `compare` flow: two sides (recipes, or a recipe with overrides: flags, env, image,
checkpoint) deployed, smoke-tested, quality-gated (when a recipe has [quality]), benchmarked and
torn down, then side by side with a verdict per row and, when asked, a ship rule's verdict
(sparkdeploy.steps.compare).

Each side is a `compare-side` subflow run, linked from the comparison's artifact. On disjoint
nodes the two run at once, each in its own thread with a copy of the flow's context (so each is
a child run of the comparison: docs/field.md, "Prefect's UI"); on shared nodes one after the
other, the first torn down before the second deploys. A side that fails is reported with its
cause and the other still runs; the comparison then fails, after its artifact is written.
"""

from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prefect import State, flow
from pydantic import Field

from flows.deploy import deploy
from sparkdeploy.errors import CompareError
from sparkdeploy.report.verdicts import NoiseRule
from sparkdeploy.steps.benchmark import DEFAULT_SETTINGS, BenchmarkSettings
from sparkdeploy.steps.compare import CompareSide, Comparison, Placement, PreparedSide
from sparkdeploy.steps.compare_outcome import SideOutcome, smoke_failure
from tasks.artifacts import artifacts_written
from tasks.benchmark import benchmark_deployment
from tasks.compare import (
    outcome_of_run,
    prepare_comparison,
    publish_comparison,
    state_failure,
)
from tasks.plan import plan_deployment
from tasks.quality import quality_gate
from tasks.smoke_test import smoke_test
from tasks.teardown import teardown_deployment


@flow(
    name="compare-side",
    flow_run_name="compare side {label}: {recipe} on {cluster}",
    on_completion=[artifacts_written],
    on_failure=[artifacts_written],
)
def compare_side(
    label: str,
    recipe: str,
    cluster: str,
    nodes: list[str],
    settings: BenchmarkSettings,
    lock_timeout_s: float = 600.0,
    quality_repeats: int = 1,
) -> SideOutcome:
    """One side: deploy (its own smoke test and quality gate skipped), smoke test, the quality
    gate's evals `quality_repeats` times when the recipe has [quality], benchmark, teardown."""
    deployed: State[Any] = deploy(
        recipe,
        cluster,
        nodes,
        skip=["smoke-test", "quality-gate"],
        lock_timeout_s=lock_timeout_s,
        return_state=True,
    )
    if not deployed.is_completed():
        # deploy tore down what it started and let the nodes go
        return SideOutcome(label, failed_at="deploy", cause=state_failure(deployed))
    summary = deployed.result()
    plan = plan_deployment(recipe, cluster, nodes)
    try:
        smoke = smoke_test(plan, raise_on_failure=False)
        if not smoke.passed:
            return SideOutcome(label, summary, smoke, failed_at="smoke", cause=smoke_failure(smoke))
        quality = []
        for _ in range(quality_repeats if plan.quality else 0):
            gated: State[Any] = quality_gate(plan, raise_on_failure=False, return_state=True)
            if not gated.is_completed():
                cause = state_failure(gated)
                return SideOutcome(label, summary, smoke, failed_at="quality", cause=cause)
            quality.append(gated.result())
        measured: State[Any] = benchmark_deployment(
            plan, settings, f"side {label}: {plan.recipe}", return_state=True
        )
        if not measured.is_completed():
            cause = state_failure(measured)
            return SideOutcome(
                label, summary, smoke, quality=tuple(quality), failed_at="benchmark", cause=cause
            )
        return SideOutcome(label, summary, smoke, measured.result(), tuple(quality))
    finally:
        teardown_deployment(plan)


@flow(
    name="compare",
    flow_run_name="compare {side_a.recipe} with {side_b.recipe} on {cluster}",
    description="Two recipes (or one with args, env, image or checkpoint overridden) deployed, "
    "smoke-tested, quality-gated, benchmarked and torn down; a side-by-side artifact with a "
    "verdict per row, and a ship rule's verdict when one is asked.",
    on_completion=[artifacts_written],
    on_failure=[artifacts_written],
)
def compare(
    side_a: CompareSide = Field(description="Side A, the baseline: a recipe and its overrides."),
    side_b: CompareSide = Field(description="Side B, compared with A: a recipe and overrides."),
    cluster: str = Field(description="The cluster both sides deploy on (clusters/<name>.toml)."),
    placement: Placement = Field(
        default="auto",
        description="sequential: one after the other on shared nodes (A torn down before B "
        "deploys); at_once: both at once on disjoint nodes; auto: at once when the cluster has "
        "room for both, else sequential.",
    ),
    settings: BenchmarkSettings = Field(
        default=DEFAULT_SETTINGS,
        description="The benchmark of each side: concurrency levels, prompt and output "
        "lengths, requests per level, repeats.",
    ),
    noise_floor: float = Field(
        default=NoiseRule().relative,
        ge=0,
        description="The smallest relative difference of a benchmark figure that counts as "
        "better or worse, whatever the spread of the repeats (0.1: 10 %).",
    ),
    latency_floor_ms: float = Field(
        default=NoiseRule().latency_floor_s * 1000,
        ge=0,
        description="The smallest latency difference (ms) that counts: the hosts' timer and "
        "scheduling jitter (the lab's shared cores: about 10).",
    ),
    lock_timeout_s: float = Field(
        default=600.0, description="How long a side waits for its nodes if another holds them."
    ),
    ship_if: str | None = Field(
        default=None,
        description='A ship rule for B, e.g. "quality>=88, decode@8192 not worse": conditions '
        "joined by , or and; each an eval of B's [quality] (its name; quality: its only one) "
        "or a figure at a context depth (decode@8192) or level (output@c4), with >= X, <= X, "
        "> X, < X (B's value) or `not worse`, `better` (B against A within noise). Its verdict "
        "heads the artifact; a rule it cannot read fails the run before anything deploys.",
    ),
    quality_repeats: int = Field(
        default=2,
        ge=1,
        le=10,
        description="Runs of the quality gate's evals per side (when its recipe has "
        "[quality]): their spread is the noise an eval's verdict allows.",
    ),
) -> Comparison:
    prepared = prepare_comparison(side_a, side_b, cluster, placement, ship_if)

    def run(side: PreparedSide) -> SideOutcome:
        return outcome_of_run(
            side.label,
            lambda: compare_side(
                side.label,
                side.recipe,
                cluster,
                side.nodes,
                settings,
                lock_timeout_s,
                quality_repeats,
                return_state=True,
            ),
        )

    if prepared.at_once:
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="compare-side") as pool:
            futures = [
                pool.submit(contextvars.copy_context().run, run, side) for side in prepared.sides
            ]
            a, b = (future.result() for future in futures)
    else:
        a, b = (run(side) for side in prepared.sides)
    noise = NoiseRule(relative=noise_floor, latency_floor_s=latency_floor_ms / 1000)
    comparison = publish_comparison(prepared, a, b, noise)
    if comparison.failed:
        raise CompareError(
            "; ".join(f"side {side.label} {side.state_text()}" for side in comparison.failed)
            + " (the comparison's artifact shows both sides)"
        )
    return comparison
