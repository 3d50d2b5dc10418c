"""Prefect task: the plans of what runs on a cluster, for the smoke watchdog."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.cluster import load_cluster
from sparkdeploy.plan import Plan
from sparkdeploy.project import find_cluster
from sparkdeploy.status import cluster_status


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
