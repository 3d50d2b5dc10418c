"""Prefect task: the plan's nodes held for its deployment (logic in
sparkdeploy.steps.hold_nodes).

In the deploy's transaction, its rollback hook gives back the nodes this call took: to the
deployment each replaced, else released (https://docs.prefect.io/v3/advanced/transactions).
"""

from __future__ import annotations

from collections.abc import Mapping

from prefect import task
from prefect.logging import get_run_logger
from prefect.transactions import Transaction, get_transaction

from sparkdeploy.errors import TransientRemoteError
from sparkdeploy.remote.docker_cli import deployments_present
from sparkdeploy.remote.node_identity import machine_ids
from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.hold_nodes import (
    DEFAULT_TIMEOUT_S,
    Replaced,
    acquire_nodes,
    give_back,
    hand_back_to_serving,
)
from tasks.boot import KEPT
from tasks.common import retried_on

# What a hold_nodes call took, kept in its own transaction for its rollback hook.
_TAKEN = "taken"
_PLAN = "plan"


@task(
    name="hold-nodes",
    task_run_name="hold-nodes {plan.deployment_id}",
    **retried_on(TransientRemoteError, 5, 30),
)
def hold_nodes(
    plan: Plan,
    *,
    lock_timeout_s: float = DEFAULT_TIMEOUT_S,
    replacing: Mapping[str, Replaced] | None = None,
) -> list[str]:
    """Hold the plan's nodes, waiting up to lock_timeout_s for another deployment to let go;
    the nodes newly taken. Held before anything is put on the nodes (a deployment that stages
    an Engram file in place or swaps a composed dir must not do it under a running one) and
    until the teardown task lets go. A holder whose flow run has ended and whose containers
    are gone from the node is taken over, with a warning naming it; so is one whose deployment
    this deploy replaces (`replacing`, sparkdeploy.steps.replace).

    The locks are the machines' (their /etc/machine-id, read here over the SSH connection the
    later steps reuse): a deployment from another inventory that names the same machine is
    waited for too."""
    logger = get_run_logger()
    targets = plan_targets(plan)
    taken = acquire_nodes(
        plan.cluster,
        machine_ids(targets),
        plan.deployment_id,
        timeout_s=lock_timeout_s,
        containers_on=lambda ids: deployments_present(targets, ids),
        replacing=replacing,
        log=logger.info,
        warn=logger.warning,
    )
    transaction = get_transaction()
    if transaction is not None:
        transaction.set(_PLAN, plan)
        transaction.set(_TAKEN, taken)
    return taken


@hold_nodes.on_rollback
def _give_back_nodes(transaction: Transaction) -> None:
    """The deploy failed: the nodes this call took go back to the deployments they were taken
    from (their containers may still run; the deploy brings back those it removed), the others
    are released. Nodes this deployment held already stay held, and all of them while its
    containers are kept for a look (keep_on_failure); where an earlier run's copy of it still
    serves (the failure came before the boot replaced it), by that run again."""
    plan: Plan = transaction.get(_PLAN)
    if transaction.get(KEPT, None) == plan.deployment_id:
        get_run_logger().info("the nodes stay held by %s, kept for a look", plan.deployment_id)
        return
    nodes = [node.node for node in plan.nodes]
    present = deployments_present(
        plan_targets(plan), {node: [plan.deployment_id] for node in nodes}
    )
    hand_back_to_serving(
        plan.cluster,
        [node for node in nodes if present.get(node)],
        plan.deployment_id,
        log=get_run_logger().info,
    )
    give_back(
        plan.cluster,
        transaction.get(_TAKEN),
        plan.deployment_id,
        log=get_run_logger().info,
    )
