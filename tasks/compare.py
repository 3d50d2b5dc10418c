"""Prefect tasks of the compare flow: the sides prepared before anything is deployed, and the
side-by-side artifact at the end (logic in sparkdeploy.steps.compare)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import State, task
from prefect.logging import get_run_logger
from prefect.utilities.urls import url_for

from sparkdeploy.errors import CompareError, InventoryError
from sparkdeploy.report.verdicts import NoiseRule
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import find_cluster, variants_dir
from sparkdeploy.steps.compare import (
    CompareSide,
    Comparison,
    Placement,
    PreparedComparison,
    checkpoint_problems,
    prepare,
)
from sparkdeploy.steps.compare_outcome import SideOutcome, failure_cause
from tasks.artifacts import publish_markdown
from tasks.common import artifact_key
from tasks.prefetch import hub_access


@task(name="compare-prepare")
def prepare_comparison(
    side_a: CompareSide,
    side_b: CompareSide,
    cluster: str,
    placement: Placement,
    ship_if: str | None = None,
) -> PreparedComparison:
    """Both sides loaded, overridden, placed and planned, a swapped checkpoint asked of the
    hub, the ship rule read; every input problem fails the run here, before a node is touched.
    No retries: such problems need a person."""
    logger = get_run_logger()
    inventory = load_cluster(find_cluster(cluster))
    missing = inventory.missing_files()
    if missing:
        raise InventoryError("\n".join(missing))
    prepared = prepare(
        side_a, side_b, inventory, placement, variants=variants_dir(), ship_if=ship_if
    )
    hub = hub_access(inventory.hub.endpoint, allow_http_token=inventory.hub.allow_http_token)
    refused, unknown = checkpoint_problems(prepared, Path(inventory.nas.hf_cache), hub)
    if refused:
        raise CompareError("\n".join(refused))
    for problem in unknown:
        logger.warning("%s (its deploy's prefetch asks again)", problem)
    for side in prepared.sides:
        logger.info(
            "side %s: %s on %s (deployment %s; recipe %s)",
            side.label,
            side.description,
            ", ".join(side.nodes),
            side.deployment_id,
            side.recipe,
        )
    logger.info("placement: %s", prepared.placement)
    if prepared.ship_rule is not None:
        conditions = "; ".join(c.text for c in prepared.ship_rule.conditions)
        logger.info("ship rule: B ships if %s", conditions)
    logger.info("%s", prepared.diff.text())
    return prepared


def state_failure(state: State[Any]) -> str:
    """Why a run (a side, its deploy, its benchmark) ended in this state."""
    error = state.result(raise_on_failure=False)
    if isinstance(error, BaseException):
        return failure_cause(error)
    return f"the run ended {state.type.value.lower()}: {state.message or 'no message'}"


def outcome_of_run(label: str, run: Callable[[], State[SideOutcome]]) -> SideOutcome:
    """A side's outcome from its flow run's final state, with the run's id; a run that could
    not even start (the Prefect API refusing it) is a failed side with that cause."""
    try:
        state = run()
    except Exception as error:
        return SideOutcome(label, failed_at="side", cause=failure_cause(error))
    run_id = str(state.state_details.flow_run_id) if state.state_details.flow_run_id else None
    if state.is_completed():
        outcome: SideOutcome = state.result()
        return dataclasses.replace(outcome, flow_run_id=run_id)
    return SideOutcome(label, failed_at="side", cause=state_failure(state), flow_run_id=run_id)


@task(name="compare-publish")
def publish_comparison(
    prepared: PreparedComparison, a: SideOutcome, b: SideOutcome, noise: NoiseRule
) -> Comparison:
    """The side-by-side table with a verdict per row, the ship rule's verdict when one was
    asked, the chart and the two runs' links, as a markdown artifact."""
    comparison = Comparison.of(prepared, a, b, noise)
    links = {
        side.label: url
        for side in (a, b)
        if side.flow_run_id and (url := url_for("flow-run", obj_id=side.flow_run_id))
    }
    publish_markdown(
        key=artifact_key("compare", f"{prepared.a.recipe_id}-vs-{prepared.b.recipe_id}"),
        markdown=comparison.markdown(links),
        description=f"A: {prepared.a.description} / B: {prepared.b.description}: "
        + comparison.summary_line(),
    )
    logger = get_run_logger()
    logger.info("%s", comparison.summary_line())
    for outcome in comparison.ship.outcomes if comparison.ship else ():
        logger.info("ship rule: %s", outcome.text())
    return comparison
