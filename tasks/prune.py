"""Prefect task: what deployments left on the nodes and what no recipe reads on the NAS, listed
and (not in a dry run) removed (logic in sparkdeploy.steps.prune); a table artifact
`prune-<cluster>`."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import find_cluster, project_root
from sparkdeploy.steps.hold_nodes import holders
from sparkdeploy.steps.prune import prune
from sparkdeploy.steps.prune.in_use import Holders
from sparkdeploy.steps.prune.rows import PruneRow, summary
from sparkdeploy.steps.status import cluster_status
from tasks.artifacts import publish_table
from tasks.common import artifact_key


# No retries: a node that does not answer fails the run with nothing removed on it, and the
# next night's run starts over from a fresh listing.
@task(name="prune", task_run_name="prune {cluster}")
def prune_cluster(cluster: str, *, dry_run: bool, min_age_hours: float) -> list[PruneRow]:
    """The prune of the cluster's nodes and NAS: one log line per item removed (or, in a dry
    run, one for the total), a `prune-<cluster>` table of every item with its bytes, its action
    and why."""
    logger = get_run_logger()
    inventory = load_cluster(find_cluster(cluster))
    nodes = [node.name for node in inventory.nodes]

    def read_holders() -> Holders:
        return {
            node: holder.deployment_id if holder else None
            for node, holder in holders(inventory.name, nodes).items()
        }

    rows = prune(
        inventory,
        project_root() / "recipes",
        cluster_status(inventory),
        read_holders,
        dry_run=dry_run,
        min_age_hours=min_age_hours,
        log=logger.info,
    )
    for row in rows:
        if row.action != "kept" or not dry_run:
            logger.info("%s %s %s on %s: %s", row.action, row.what, row.path, row.where, row.why)
    verdict = summary(rows, dry_run=dry_run)
    logger.info("%s", verdict)
    publish_table(
        key=artifact_key("prune", inventory.name),
        table=[row.as_row() for row in rows],
        description=f"{'Dry run: ' if dry_run else ''}{verdict}",
    )
    return rows
