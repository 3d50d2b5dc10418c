"""Prefect tasks of a replacing deploy: what it replaces, the replaced deployments' containers
removed just before the new ones boot, and the replacement committed once the new deployment
passed its smoke test (logic in sparkdeploy.steps.replace and sparkdeploy.steps.hold_nodes)."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.remote.node_identity import machine_ids
from sparkdeploy.remote.targets import cluster_targets
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import Plan
from sparkdeploy.spec.project import find_cluster
from sparkdeploy.steps.hold_nodes import acquire_nodes, commit_replacement, ended_runs, holders
from sparkdeploy.steps.replace import Replacement, plan_replacement
from sparkdeploy.steps.status import cluster_status
from sparkdeploy.steps.teardown import teardown

# How long a replaced deployment's other nodes may take to be recorded as this run's (they are
# its own records, or free: no wait is expected).
ADOPT_TIMEOUT_S = 30.0


@task(name="replace-find")
def find_replacement(plan: Plan, cluster: str) -> Replacement:
    """The deployments this deploy replaces on its nodes, and those it would bring back if it
    failed; ReplaceRefused, before anything is touched, for one that could not be brought back."""
    by_node = holders(plan.cluster, [node.node for node in plan.nodes])
    ended = ended_runs({holder.flow_run_id for holder in by_node.values() if holder})
    statuses = cluster_status(load_cluster(find_cluster(cluster)))
    replacement = plan_replacement(plan, by_node, lambda run: run in ended, statuses)
    get_run_logger().info("%s", replacement.describe(plan.deployment_id))
    return replacement


@task(name="replace-retire")
def retire_replaced(plan: Plan, replacement: Replacement, cluster: str) -> list[str]:
    """Every replaced deployment's containers removed from the cluster (logs kept on the NAS),
    its nodes outside this plan kept for it by this run, so that a failure can bring it back on
    all of them. Returns the deployments removed."""
    logger = get_run_logger()
    inventory = load_cluster(find_cluster(cluster))
    targets = cluster_targets(inventory)
    planned = {node.node for node in plan.nodes}
    retired = []
    for deployment_id in replacement.replacing:
        if deployment_id == plan.deployment_id:
            continue
        teardown(deployment_id, targets, inventory.nas.runs_dir, log=logger.info)
        retired.append(deployment_id)
    for old in replacement.bring_back:
        others = [node for node in old.nodes if node not in planned]
        if others:
            acquire_nodes(
                plan.cluster,
                machine_ids({node: targets[node] for node in others}),
                old.deployment_id,
                timeout_s=ADOPT_TIMEOUT_S,
                log=logger.info,
            )
    return retired


@task(name="replace-commit")
def commit(plan: Plan, replacement: Replacement) -> list[str]:
    """The new deployment serves: its node records stop naming what they replaced, and the
    replaced deployments let go of their other nodes. Returns the nodes let go."""
    return commit_replacement(
        plan.cluster,
        [node.node for node in plan.nodes],
        plan.deployment_id,
        replacement.bring_back,
        log=get_run_logger().info,
    )
