"""Prefect task: the plan's nodes held for its deployment (logic in
sparkdeploy.steps.hold_nodes)."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.errors import TransientRemoteError
from sparkdeploy.model.plan import Plan
from sparkdeploy.remote.docker_cli import deployments_present
from sparkdeploy.remote.node_identity import machine_ids
from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.steps.hold_nodes import DEFAULT_TIMEOUT_S, acquire_nodes, release_nodes
from tasks.common import retry_only


@task(
    name="hold-nodes",
    retries=2,
    retry_delay_seconds=[5, 30],
    retry_condition_fn=retry_only(TransientRemoteError),
)
def hold_nodes(plan: Plan, *, lock_timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Hold the plan's nodes, waiting up to lock_timeout_s for another deployment to let go;
    the nodes newly taken. Held before anything is put on the nodes (a deployment that stages
    an Engram file in place or swaps a composed dir must not do it under a running one) and
    until the teardown task lets go. A holder whose flow run has ended and whose containers
    are gone from the node is taken over, with a warning naming it.

    The locks are the machines' (their /etc/machine-id, read here over the SSH connection the
    later steps reuse): a deployment from another inventory that names the same machine is
    waited for too."""
    logger = get_run_logger()
    targets = plan_targets(plan)
    return acquire_nodes(
        plan.cluster,
        machine_ids(targets),
        plan.deployment_id,
        timeout_s=lock_timeout_s,
        containers_on=lambda holders: deployments_present(targets, holders),
        log=logger.info,
        warn=logger.warning,
    )


@task(name="let-go-of-nodes")
def let_go_of_nodes(plan: Plan, nodes: list[str]) -> list[str]:
    """The given nodes of the plan released by its deployment (those a failed run took before
    it put anything on them); the nodes let go."""
    return release_nodes(plan.cluster, nodes, plan.deployment_id, log=get_run_logger().info)
