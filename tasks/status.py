"""Prefect task: what runs on a cluster, with what Prefect remembers of it (logic in
sparkdeploy.steps.status and sparkdeploy.report.history)."""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import get_client, task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from sparkdeploy.report.history import read_history
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import find_cluster
from sparkdeploy.steps.status import DeploymentStatus, cluster_status
from tasks.artifacts import publish_table
from tasks.common import artifact_key


# Its result holds the plans, with their secrets: never persisted, never cached
# (tasks/common.py).
@task(name="status", persist_result=False, cache_policy=NO_CACHE)
def read_cluster_status(cluster: str) -> list[DeploymentStatus]:
    """Every deployment of ours on the cluster: its head's health, uptime, last smoke test and
    last health event; a table artifact."""
    logger = get_run_logger()
    inventory = load_cluster(find_cluster(cluster))
    statuses = cluster_status(inventory)
    now = datetime.now(UTC)
    with get_client(sync_client=True) as client:
        history = read_history(client, [status.deployment_id for status in statuses], now)
    for status in statuses:
        logger.info("%s", status.line(now, history.get(status.deployment_id)))
    if not statuses:
        logger.info("nothing of ours runs on %s", ", ".join(n.name for n in inventory.nodes))
    publish_table(
        key=artifact_key("status", inventory.name),
        table=[
            row
            for status in statuses
            for row in status.rows(now, history.get(status.deployment_id))
        ],
        description=f"Deployments on cluster {inventory.name}",
    )
    return statuses
