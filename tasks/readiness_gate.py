"""Prefect task: the readiness gate over a booted deployment (logic in
sparkdeploy.steps.readiness_gate).

No retries: a boot that failed is not transient, and waiting again would only hide its cause.
The readiness-gate artifact (the boot timeline) is written however the gate ends, so a failed
boot shows how far it got and what it printed last.
"""

from __future__ import annotations

import time

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.errors import BootFailed
from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.readiness_gate import GateResult, ReadinessGate, gate_for, wait_until_ready
from tasks.artifacts import publish_table
from tasks.common import artifact_key


def _figures_text(figures: dict[str, float]) -> str:
    return ", ".join(f"{name}={value:g}" for name, value in figures.items())


def timeline_rows(gate: ReadinessGate, failure: BootFailed | None) -> list[dict[str, str]]:
    """One row per marker seen (and a last row for the failure, if any)."""
    rows = [
        {
            "marker": entry.marker,
            "node": entry.node,
            "seconds": f"{entry.seconds:.3f}",
            "figures": _figures_text(entry.figures),
            "line": entry.line,
        }
        for entry in gate.timeline
    ]
    if failure is not None:
        rows.append(
            {
                "marker": f"FAILED: {failure.kind}",
                "node": failure.node,
                "seconds": f"{time.monotonic() - gate.watch.started_at:.3f}",
                "figures": "",
                "line": failure.cause,
            }
        )
    return rows


@task(name="readiness-gate", task_run_name="readiness-gate {plan.deployment_id}", retries=0)
def readiness_gate(plan: Plan, timeout_s: float | None = None) -> GateResult:
    """Ready = every marker on every node, then /health and /v1/models; else BootFailed.

    `timeout_s` defaults to the recipe's readiness timeout.
    """
    logger = get_run_logger()
    nodes = ", ".join(f"{node.node} ({node.role})" for node in plan.nodes)
    logger.info("following the containers of %s on %s", plan.deployment_id, nodes)
    gate = gate_for(plan)
    failure: BootFailed | None = None
    try:
        result = wait_until_ready(plan, gate, timeout_s=timeout_s)
    except BootFailed as error:
        failure = error
        logger.error("%s", error)
        raise
    finally:
        publish_table(
            key=artifact_key("readiness-gate", plan.deployment_id),
            table=timeline_rows(gate, failure),
            description=(
                f"Boot of {plan.deployment_id} ({plan.recipe} on {plan.cluster}): each marker, "
                "the node, seconds since the gate started, the parsed figures"
                + (f". FAILED on {failure.node}: {failure.kind}" if failure else "")
            ),
        )
    logger.info(
        "%s ready at %s after %.1f s (%s)",
        plan.served_model_name,
        plan.endpoint,
        result.ready_after_s,
        _figures_text(result.figures),
    )
    return result
