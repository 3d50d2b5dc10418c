"""Prefect task: what runs on a cluster, with what Prefect remembers of it (logic in
sparkdeploy.steps.status_view)."""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import get_client, task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import find_cluster
from sparkdeploy.steps.status import DeploymentStatus
from sparkdeploy.steps.status_view import read_status
from tasks.artifacts import publish_markdown
from tasks.common import artifact_key


# Its result holds the plans, with their secrets: never persisted, never cached
# (tasks/common.py).
@task(name="status", persist_result=False, cache_policy=NO_CACHE)
def read_cluster_status(cluster: str) -> list[DeploymentStatus]:
    """Every deployment of ours on the cluster: its health, healthy since, the sentinel's last
    probe, its last fault, repairs this hour, last smoke test and bytes on each node; a markdown
    artifact."""
    logger = get_run_logger()
    inventory = load_cluster(find_cluster(cluster))
    with get_client(sync_client=True) as client:
        report = read_status(inventory, client, datetime.now(UTC))
    for line in report.lines():
        logger.info("%s", line)
    if not report.rows:
        logger.info("nothing of ours runs on %s", ", ".join(n.name for n in inventory.nodes))
    publish_markdown(
        key=artifact_key("status", inventory.name),
        markdown=report.markdown(),
        description=f"Deployments on cluster {inventory.name}",
    )
    return report.statuses
