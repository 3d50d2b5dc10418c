"""Prefect task: the plan's containers started on nodes its deployment holds (logic in
sparkdeploy.steps.boot)."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.model.plan import Plan
from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.steps.boot import BootResult, boot
from sparkdeploy.steps.hold_nodes import holders
from sparkdeploy.steps.teardown import teardown


@task(name="boot")
def boot_deployment(plan: Plan) -> BootResult:
    """Preflight, stale containers out, the plan's containers started. The caller holds the
    nodes (tasks.hold_nodes); a failed boot leaves no container of the deployment behind."""
    logger = get_run_logger()
    held = holders(plan.cluster, [node.node for node in plan.nodes])
    try:
        return boot(
            plan,
            held_by={
                node: holder.deployment_id if holder else None for node, holder in held.items()
            },
            log=logger.info,
        )
    except BaseException:
        teardown(plan.deployment_id, plan_targets(plan), plan.runs_dir, log=logger.info)
        raise
