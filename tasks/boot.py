"""Prefect task: the plan's containers started on nodes its deployment holds (logic in
sparkdeploy.steps.boot).

In the deploy's transaction, its rollback hook removes what it started when a later step (the
readiness gate, the smoke test) fails, logs kept, unless the deploy keeps a failure for
inspection (https://docs.prefect.io/v3/advanced/transactions).
"""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from prefect.transactions import Transaction, get_transaction

from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.boot import BootResult, boot
from sparkdeploy.steps.hold_nodes import holders
from sparkdeploy.steps.teardown import teardown

_PLAN = "plan"
# Set by the deploy flow on its transaction: leave a failed deployment's containers for a look.
KEEP_ON_FAILURE = "keep_on_failure"
# Set on the deploy's transaction by the rollback hook when it kept the containers: the nodes
# then stay held too (tasks.hold_nodes).
KEPT = "kept"


@task(name="boot", task_run_name="boot {plan.deployment_id}")
def boot_deployment(plan: Plan) -> BootResult:
    """Preflight, stale containers out, the plan's containers started. The caller holds the
    nodes (tasks.hold_nodes); a failed boot leaves no container of the deployment behind."""
    logger = get_run_logger()
    held = holders(plan.cluster, [node.node for node in plan.nodes])
    try:
        result = boot(
            plan,
            held_by={
                node: holder.deployment_id if holder else None for node, holder in held.items()
            },
            started_by=str(flow_run.id) if flow_run.id else None,
            log=logger.info,
        )
    except BaseException:
        teardown(plan.deployment_id, plan_targets(plan), plan.runs_dir, log=logger.info)
        raise
    transaction = get_transaction()
    if transaction is not None:
        transaction.set(_PLAN, plan)
    return result


@boot_deployment.on_rollback
def _remove_started_containers(transaction: Transaction) -> None:
    logger = get_run_logger()
    plan: Plan = transaction.get(_PLAN)
    if transaction.get(KEEP_ON_FAILURE, False):
        logger.warning(
            "keep_on_failure: the containers of %s stay on %s for a look; tear them down with"
            " the teardown flow",
            plan.deployment_id,
            ", ".join(node.node for node in plan.nodes),
        )
        deploy_transaction = transaction.get_parent()
        if deploy_transaction is not None:
            deploy_transaction.set(KEPT, plan.deployment_id)
        return
    teardown(plan.deployment_id, plan_targets(plan), plan.runs_dir, log=logger.info)
