"""Prefect task: node locks taken, then the plan's containers started (logic in
sparkdeploy.locks and sparkdeploy.boot)."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.boot import DEFAULT_MIN_MEMORY_BYTES, BootResult, boot
from sparkdeploy.locks import DEFAULT_TIMEOUT_S, acquire_nodes, release_nodes
from sparkdeploy.plan import Plan
from sparkdeploy.targets import plan_targets
from sparkdeploy.teardown import teardown


@task(name="boot")
def boot_deployment(
    plan: Plan,
    *,
    lock_timeout_s: float = DEFAULT_TIMEOUT_S,
    min_memory_bytes: int = DEFAULT_MIN_MEMORY_BYTES,
) -> BootResult:
    """Hold the plan's nodes (waiting up to lock_timeout_s for another deployment to let go),
    then boot. The locks stay held until the teardown task; a failed boot leaves nothing: its
    containers are removed and its nodes released."""
    logger = get_run_logger()
    nodes = [node.node for node in plan.nodes]
    acquire_nodes(
        plan.cluster, nodes, plan.deployment_id, timeout_s=lock_timeout_s, log=logger.info
    )
    try:
        result = boot(
            plan,
            drop_page_cache=plan.drop_page_cache,
            min_memory_bytes=min_memory_bytes,
            log=logger.info,
        )
    except BaseException:
        teardown(plan.deployment_id, plan_targets(plan), plan.runs_dir, log=logger.info)
        # Nothing of the deployment is left on the nodes, so none of them stays held by it.
        release_nodes(plan.cluster, nodes, plan.deployment_id, log=logger.info)
        raise
    return result
