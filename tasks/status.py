"""Prefect task: what runs on a cluster (logic in sparkdeploy.steps.status)."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger

from sparkdeploy.model.cluster import load_cluster
from sparkdeploy.model.project import find_cluster
from sparkdeploy.steps.status import DeploymentStatus, cluster_status
from tasks.common import artifact_key


@task(name="cluster-status")
def read_cluster_status(cluster: str) -> list[DeploymentStatus]:
    """Every deployment of ours on the cluster, with its head's health; a table artifact."""
    logger = get_run_logger()
    inventory = load_cluster(find_cluster(cluster))
    statuses = cluster_status(inventory)
    for status in statuses:
        logger.info(
            "%s (%s) on %s since %s: %s",
            status.deployment_id,
            status.recipe,
            ", ".join(status.nodes),
            status.since,
            "healthy" if status.healthy else f"NOT healthy: {status.health}",
        )
    if not statuses:
        logger.info("nothing of ours runs on %s", ", ".join(n.name for n in inventory.nodes))
    create_table_artifact(
        key=artifact_key("status", inventory.name),
        table=[row for status in statuses for row in status.rows()],
        description=f"Deployments on cluster {inventory.name}",
    )
    return statuses
