"""Prefect tasks of the smoke watchdog: what runs on a cluster, and why a deployment is down."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.logging import get_run_logger

from sparkdeploy.errors import TransientRemoteError
from sparkdeploy.model.cluster import load_cluster
from sparkdeploy.model.plan import Plan
from sparkdeploy.model.project import find_cluster
from sparkdeploy.steps.status import cluster_status
from sparkdeploy.steps.watchdog import diagnose, node_states
from tasks.common import artifact_key, retry_only


@task(name="running-deployments")
def running_plans(cluster: str) -> list[Plan]:
    """A plan per deployment running on the cluster whose head is up, rebuilt from its labels."""
    logger = get_run_logger()
    inventory = load_cluster(find_cluster(cluster))
    statuses = cluster_status(inventory)
    plans = []
    for status in statuses:
        if status.plan is None:
            logger.warning("%s: %s", status.deployment_id, status.health)
        else:
            plans.append(status.plan)
    return plans


@task(
    name="diagnose",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=retry_only(TransientRemoteError),
)
def diagnose_deployment(plan: Plan) -> None:
    """After a failed smoke test: DeploymentDown naming the node and cause, when the containers'
    states or the head's log show one (else the smoke test's own failure stands)."""
    logger = get_run_logger()
    down = diagnose(plan, node_states(plan))
    if down is None:
        logger.info("%s: every container runs and the head's log has no fatal line", plan.recipe)
        return
    create_markdown_artifact(
        key=artifact_key("down", plan.deployment_id),
        markdown=f"```\n{down}\n```",
        description=f"{plan.deployment_id} is down: {down.node} ({down.kind})",
    )
    logger.error("%s", down)
    raise down
