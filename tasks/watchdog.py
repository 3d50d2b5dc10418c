"""Prefect tasks of the smoke watchdog: what runs on a cluster, and each deployment's health as
a Prefect event (logic in sparkdeploy.steps.status, sparkdeploy.steps.watchdog and
sparkdeploy.spec.events)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.futures import PrefectFuture
from prefect.logging import get_run_logger

from sparkdeploy.errors import TransientRemoteError
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.events import Health, health_event
from sparkdeploy.spec.plan import Plan
from sparkdeploy.spec.project import find_cluster
from sparkdeploy.steps.hold_nodes import ended_runs, holders
from sparkdeploy.steps.status import cluster_status
from sparkdeploy.steps.watchdog import being_deployed, diagnose, node_states
from tasks.artifacts import publish_markdown
from tasks.common import artifact_key, retried_on


# Its result holds the recipe's secrets: never persisted, never cached (tasks/common.py).
@task(name="watchdog-targets", persist_result=False, cache_policy=NO_CACHE)
def running_plans(cluster: str) -> list[Plan]:
    """A plan per deployment of ours on the cluster, rebuilt from its labels; those a deploy is
    busy with are left for the next round."""
    logger = get_run_logger()
    inventory = load_cluster(find_cluster(cluster))
    statuses = cluster_status(inventory)
    by_node = holders(inventory.name, [node.name for node in inventory.nodes])
    runs = {holder.flow_run_id for holder in by_node.values() if holder is not None}
    live = runs - ended_runs(runs)
    plans = []
    for status in statuses:
        busy = being_deployed(status, by_node, live)
        if status.plan is None:
            logger.warning("%s: %s", status.deployment_id, status.health)
        elif busy is not None:
            logger.info("%s: left alone this time: %s", status.deployment_id, busy)
        else:
            plans.append(status.plan)
    return plans


def failure_of(future: PrefectFuture[Any]) -> str | None:
    """The error a finished task run failed with, as text; None when it completed."""
    if not future.state.is_failed():
        return None
    return str(future.state.result(raise_on_failure=False))


@task(
    name="watchdog-health",
    task_run_name="watchdog-health {plan.deployment_id}",
    **retried_on(TransientRemoteError, 5, 5),
)
def report_health(plan: Plan, cluster: str, smoke_failure: str | None) -> Health:
    """The deployment's health as a Prefect event (sparkdeploy.spec.events): healthy when its smoke
    test passed; else the node and cause DeploymentDown names when the containers' states or
    the head's log show one (then raised), else the smoke test's own failure."""
    logger = get_run_logger()
    down = None
    if smoke_failure is None:
        health = Health.ok(plan)
    else:
        down = diagnose(plan, node_states(plan))
        if down is None:
            logger.info(
                "%s: every container runs and the head's log has no fatal line", plan.recipe
            )
            health = Health(False, plan.head.node, "smoke_failed", smoke_failure)
        else:
            publish_markdown(
                key=artifact_key("down", plan.deployment_id),
                markdown=f"```\n{down}\n```",
                description=f"{plan.deployment_id} is down: {down.node} ({down.kind})",
            )
            logger.error("%s", down)
            health = Health(False, down.node, down.kind, down.cause)
    event = health_event(plan, cluster, health)
    emit_event(**event)
    logger.info("event %s: %s on %s: %s", event["event"], health.kind, health.node, health.cause)
    if down is not None:
        raise down
    return health
