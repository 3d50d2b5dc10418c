"""Prefect task: a deployment's containers removed, logs kept, node locks released
(logic in sparkdeploy.steps.teardown and sparkdeploy.steps.hold_nodes)."""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from typing import Any

from prefect import Flow, State, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import FlowRun
from prefect.logging import get_run_logger
from prefect.logging.loggers import flow_run_logger
from prefect.utilities.callables import get_parameter_defaults

from sparkdeploy.errors import InventoryError, SparkDeployError, TransientRemoteError
from sparkdeploy.remote.docker_cli import deployments_present
from sparkdeploy.remote.ssh import SshTarget
from sparkdeploy.remote.targets import cluster_targets, plan_targets
from sparkdeploy.spec.cluster import Cluster, load_cluster
from sparkdeploy.spec.labels import STARTED_BY_LABEL
from sparkdeploy.spec.plan import SPEC_LABEL, Plan
from sparkdeploy.spec.project import find_cluster, load_plan, recipe_id_named
from sparkdeploy.steps.hold_nodes import (
    NodeHolder,
    give_back,
    hand_back_to_serving,
    holders,
    release_nodes,
)
from sparkdeploy.steps.teardown import (
    TeardownReport,
    left_on_nodes,
    recipe_containers,
    recipe_deployments,
    recipe_teardown,
    teardown,
)
from tasks.artifacts import publish_markdown
from tasks.common import artifact_key, retried_on


def _excerpt_markdown(report: TeardownReport) -> str:
    if not report.removed:
        return f"Deployment `{report.deployment_id}`: no containers were running."
    parts = [f"# Teardown of `{report.deployment_id}`"]
    parts.extend(
        f"## {container.node}: `{container.name}` ({container.status}, exit"
        f" {container.exit_code})\nFull log: `{container.log_path}`"
        f" ({container.log_bytes} bytes)\n\n```\n" + "\n".join(container.excerpt) + "\n```"
        for container in report.removed
    )
    return "\n\n".join(parts)


@task(
    name="teardown",
    task_run_name="teardown {plan.deployment_id}",
    **retried_on(TransientRemoteError, 5, 30),
)
def teardown_deployment(plan: Plan) -> TeardownReport:
    """The plan's nodes searched for the deployment's containers (by label): logged to the NAS,
    removed; then the node locks it holds released. A second run finds nothing."""
    logger = get_run_logger()
    report = teardown(plan.deployment_id, plan_targets(plan), plan.runs_dir, log=logger.info)
    release_nodes(
        plan.cluster, [node.node for node in plan.nodes], plan.deployment_id, log=logger.info
    )
    composed = plan.head.composed
    left = left_on_nodes(
        plan.cluster,
        [node.node for node in plan.nodes],
        composed.root if composed else None,
        composed.local_files if composed else [],
    )
    logger.info("%s", left)
    _publish(report, left)
    return report


@task(
    name="teardown",
    task_run_name="teardown {deployment_id}",
    **retried_on(TransientRemoteError, 5, 30),
)
def teardown_deployment_id(deployment_id: str, cluster: str) -> TeardownReport:
    """A deployment by its id alone, whatever its recipe says now: its containers on every node
    of the cluster (by label) logged to the NAS and removed, then the node locks its records
    name released. A second run finds nothing."""
    logger = get_run_logger()
    inventory = _inventory(cluster)
    report = teardown(
        deployment_id, cluster_targets(inventory), inventory.nas.runs_dir, log=logger.info
    )
    release_nodes(
        inventory.name, [node.name for node in inventory.nodes], deployment_id, log=logger.info
    )
    left = left_on_nodes(
        inventory.name,
        sorted({container.node for container in report.removed})
        or [node.name for node in inventory.nodes],
        posixpath.join(inventory.node_paths.composed_root, deployment_id),
        [],
        known=False,
    )
    logger.info("%s", left)
    _publish(report, left)
    return report


def _inventory(cluster: str) -> Cluster:
    """The cluster's inventory, refused (as a deploy's plan refuses it) when files it names,
    such as its SSH keys, are missing on this host."""
    inventory = load_cluster(find_cluster(cluster))
    missing = inventory.missing_files()
    if missing:
        raise InventoryError("\n".join(missing))
    return inventory


def _publish(report: TeardownReport, left: str) -> None:
    publish_markdown(
        key=artifact_key("teardown", report.deployment_id),
        markdown=f"{_excerpt_markdown(report)}\n\n{left}",
        description=f"Container log excerpts of {report.deployment_id}",
    )


# Its result holds a plan, with its secrets: never persisted, never cached (tasks/common.py).
@task(
    name="teardown-target",
    task_run_name="teardown-target {recipe}",
    persist_result=False,
    cache_policy=NO_CACHE,
)
def find_recipe_teardown(
    recipe: str, cluster: str, nodes: list[str] | None = None
) -> tuple[Plan | None, list[str]]:
    """Which deployment a teardown of `recipe` takes down (sparkdeploy.steps.teardown.
    recipe_teardown), from the recipe planned now and what runs of it on the cluster (its
    containers' recipe label, the node lock records): its plan, to tear down as always, or
    else the ids of the deployments to tear down by id (none: nothing of it is left). What it
    finds that the recipe no longer plans is said in the run's log."""
    logger = get_run_logger()
    inventory = _inventory(cluster)
    plan: Plan | None = None
    unplanned: str | None = None
    try:
        plan = load_plan(recipe, cluster, nodes)
    except SparkDeployError as error:
        unplanned = str(error)
    recipe_id = plan.recipe if plan is not None else recipe_id_named(recipe)
    node_names = [node.name for node in inventory.nodes]
    held = holders(inventory.name, node_names)
    found = recipe_deployments(
        recipe_id,
        recipe_containers(cluster_targets(inventory), recipe_id),
        {node: holder.deployment_id if holder else None for node, holder in held.items()},
    )
    chosen = recipe_teardown(
        recipe_id,
        inventory.name,
        found,
        plan_id=plan.deployment_id if plan is not None else None,
        plan_nodes=[node.node for node in plan.nodes] if plan is not None else [],
        plan_specs=(
            {node.node: node.container.labels[SPEC_LABEL] for node in plan.nodes}
            if plan is not None
            else None
        ),
        unplanned=unplanned,
        nodes=nodes,
    )
    for note in chosen.notes:
        logger.warning("%s", note)
    return (plan if chosen.by_plan else None), chosen.deployment_ids


def tear_down_abandoned_run(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    """The deploy flow's on_cancellation and on_crashed hook: what the run started is torn down
    (logs kept) and the nodes it holds let go.

    With a process worker, the flow's process gets SIGTERM first when the run is cancelled and
    its own failure path may tear down already; the worker runs this hook after that process
    has ended (SIGKILLed, maybe, before its teardown finished), and also when the process died
    on its own (killed, out of memory: the run is Crashed), outside the run's context: it knows
    only the run's parameters and plans again from them. A recipe deleted, broken or changed
    since the run began (another required_nodes plans another deployment id) cannot tell it
    what the run deployed: then the lock records of its own run do (their deployment id and
    nodes; nothing is put on a node before it is held), and it never raises for the recipe. On
    the nodes this run holds it
    removes only the containers it started itself (labels.STARTED_BY_LABEL): a redeploy of a
    serving deployment holds its nodes from the start of its prefetch, and the copy an earlier
    run left serving there must survive its cancel; such a node goes back to the run whose hold
    it took over (hold_nodes.hand_back_to_serving). On free nodes it removes every container of
    the deployment (an orphan of this run), and it never touches a node another run holds; a
    node it took from a deployment it was replacing goes back to that one
    (sparkdeploy.steps.hold_nodes.give_back), for the next ensure or replacing deploy to bring
    back. A worker killed alone runs no hook of its own: the flow's process either goes on and
    finishes the deploy or ends Crashed itself and runs this hook. Killed together with that
    process (the machine died), nothing runs a hook: the run stays Running in Prefect and the
    next deploy of its nodes waits for it, naming it, until a person tears that deployment down
    (the teardown flow).
    """
    logger = flow_run_logger(flow_run, flow)
    parameters = {**get_parameter_defaults(flow.fn), **flow_run.parameters}
    run_id = str(flow_run.id)
    how = "cancelled" if state.is_cancelling() or state.is_cancelled() else "crashed"
    inventory = load_cluster(find_cluster(parameters["cluster"]))
    every = holders(inventory.name, [node.name for node in inventory.nodes])
    own = {node: h for node, h in every.items() if h is not None and h.flow_run_id == run_id}
    plan: Plan | None = None
    try:
        plan = load_plan(parameters["recipe"], parameters["cluster"], parameters["nodes"])
    except SparkDeployError as error:
        why = f"recipe {parameters['recipe']} cannot be planned ({error})"
    if plan is not None:
        if {holder.deployment_id for holder in own.values()} <= {plan.deployment_id}:
            _tear_down_run(
                logger.info,
                how,
                run_id,
                plan.deployment_id,
                plan.cluster,
                {node.node: every[node.node] for node in plan.nodes},
                plan_targets(plan),
                plan.runs_dir,
            )
            return
        why = (
            f"recipe {parameters['recipe']} now plans deployment {plan.deployment_id}, not the"
            " one this run holds nodes for"
        )
    # The recipe changed or vanished since the run began: what the run holds, its own lock
    # records say (nothing is put on a node before it is held).
    if not own:
        logger.warning(f"{how}: {why}, and this run holds no node: nothing of it to tear down")
        return
    logger.warning(f"{how}: {why}: tearing down by this run's node lock records")
    targets = cluster_targets(inventory)
    for deployment_id in sorted({holder.deployment_id for holder in own.values()}):
        held: dict[str, NodeHolder | None] = {
            node: holder for node, holder in own.items() if holder.deployment_id == deployment_id
        }
        _tear_down_run(
            logger.info,
            how,
            run_id,
            deployment_id,
            inventory.name,
            held,
            {node: targets[node] for node in held},
            inventory.nas.runs_dir,
        )


def _tear_down_run(
    log: Callable[[str], None],
    how: str,
    run_id: str,
    deployment_id: str,
    cluster: str,
    by_node: dict[str, NodeHolder | None],
    all_targets: dict[str, SshTarget],
    runs_dir: str,
) -> None:
    """tear_down_abandoned_run's work on a deployment's nodes (node -> its holder)."""
    ours = [
        node for node, holder in by_node.items() if holder is None or holder.flow_run_id == run_id
    ]
    held = [node for node in ours if by_node[node] is not None]
    targets = {node: target for node, target in all_targets.items() if node in ours}
    report = teardown(
        deployment_id,
        targets,
        runs_dir,
        select=lambda node, container: (
            node not in held or container.labels.get(STARTED_BY_LABEL) == run_id
        ),
        log=log,
    )
    present = deployments_present(targets, {node: [deployment_id] for node in held}) if held else {}
    serving = [node for node in held if present.get(node)]
    handed_back = hand_back_to_serving(cluster, serving, deployment_id, flow_run_id=run_id, log=log)
    given = give_back(
        cluster,
        [node for node in held if node not in handed_back],
        deployment_id,
        flow_run_id=run_id,
        log=log,
    )
    released = [node for node, to in given.items() if to is None]
    handed = [f"{node} to {to}" for node, to in given.items() if to is not None] + [
        f"{node} to the copy of {deployment_id} still serving there" for node in handed_back
    ]
    removed = ", ".join(f"{c.name} on {c.node}" for c in report.removed) or "no container left"
    others = [node for node in by_node if node not in ours]
    log(
        f"{how}: tore down {deployment_id} ({removed}) on nodes {', '.join(ours) or 'none'},"
        f" released {', '.join(released) or 'none (none was still held by this run)'}"
        + (f", gave back {', '.join(handed)}" if handed else "")
        + (f"; left {', '.join(others)} to the deployment holding them" if others else "")
    )
