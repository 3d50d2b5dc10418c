"""Prefect task: a deployment's containers removed, logs kept, node locks released
(logic in sparkdeploy.steps.teardown and sparkdeploy.steps.hold_nodes)."""

from __future__ import annotations

from typing import Any

from prefect import Flow, task
from prefect.client.schemas.objects import FlowRun
from prefect.logging import get_run_logger
from prefect.logging.loggers import flow_run_logger
from prefect.states import State
from prefect.utilities.callables import get_parameter_defaults

from sparkdeploy.errors import TransientRemoteError
from sparkdeploy.model.labels import STARTED_BY_LABEL
from sparkdeploy.model.plan import Plan
from sparkdeploy.model.project import load_plan
from sparkdeploy.remote.docker_cli import deployments_present
from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.steps.hold_nodes import give_back, hand_back_to_serving, holders, release_nodes
from sparkdeploy.steps.teardown import TeardownReport, teardown
from tasks.artifacts import publish_markdown
from tasks.common import artifact_key, retry_only


def _excerpt_markdown(report: TeardownReport) -> str:
    if not report.removed:
        return f"Deployment `{report.deployment_id}`: no containers were running."
    parts = [f"# Teardown of `{report.deployment_id}`"]
    for container in report.removed:
        parts.append(
            f"## {container.node}: `{container.name}` ({container.status}, exit"
            f" {container.exit_code})\nFull log: `{container.log_path}`"
            f" ({container.log_bytes} bytes)\n\n```\n" + "\n".join(container.excerpt) + "\n```"
        )
    return "\n\n".join(parts)


@task(
    name="teardown",
    task_run_name="teardown {plan.deployment_id}",
    retries=2,
    retry_delay_seconds=[5, 30],
    retry_condition_fn=retry_only(TransientRemoteError),
)
def teardown_deployment(plan: Plan) -> TeardownReport:
    """The plan's nodes searched for the deployment's containers (by label): logged to the NAS,
    removed; then the node locks it holds released. A second run finds nothing."""
    logger = get_run_logger()
    report = teardown(plan.deployment_id, plan_targets(plan), plan.runs_dir, log=logger.info)
    release_nodes(
        plan.cluster, [node.node for node in plan.nodes], plan.deployment_id, log=logger.info
    )
    publish_markdown(
        key=artifact_key("teardown", plan.deployment_id),
        markdown=_excerpt_markdown(report),
        description=f"Container log excerpts of {plan.deployment_id}",
    )
    return report


def tear_down_abandoned_run(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    """The deploy flow's on_cancellation and on_crashed hook: what the run started is torn down
    (logs kept) and the nodes it holds let go.

    With a process worker, the flow's process gets SIGTERM first when the run is cancelled and
    its own failure path may tear down already; the worker runs this hook after that process
    has ended (SIGKILLed, maybe, before its teardown finished), and also when the process died
    on its own (killed, out of memory: the run is Crashed), outside the run's context: it knows
    only the run's parameters and plans again from them. On the nodes this run holds it
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
    plan = load_plan(parameters["recipe"], parameters["cluster"], parameters["nodes"])
    by_node = holders(plan.cluster, [node.node for node in plan.nodes])
    run_id = str(flow_run.id)
    ours = [
        node for node, holder in by_node.items() if holder is None or holder.flow_run_id == run_id
    ]
    held = [node for node in ours if by_node[node] is not None]
    targets = {node: target for node, target in plan_targets(plan).items() if node in ours}
    report = teardown(
        plan.deployment_id,
        targets,
        plan.runs_dir,
        select=lambda node, container: (
            node not in held or container.labels.get(STARTED_BY_LABEL) == run_id
        ),
        log=logger.info,
    )
    present = (
        deployments_present(targets, {node: [plan.deployment_id] for node in held}) if held else {}
    )
    serving = [node for node in held if present.get(node)]
    handed_back = hand_back_to_serving(
        plan.cluster, serving, plan.deployment_id, flow_run_id=run_id, log=logger.info
    )
    given = give_back(
        plan.cluster,
        [node for node in held if node not in handed_back],
        plan.deployment_id,
        flow_run_id=run_id,
        log=logger.info,
    )
    released = [node for node, to in given.items() if to is None]
    handed = [f"{node} to {to}" for node, to in given.items() if to is not None] + [
        f"{node} to the copy of {plan.deployment_id} still serving there" for node in handed_back
    ]
    removed = ", ".join(f"{c.name} on {c.node}" for c in report.removed) or "no container left"
    others = [node for node in by_node if node not in ours]
    how = "cancelled" if state.is_cancelling() or state.is_cancelled() else "crashed"
    logger.info(
        f"{how}: tore down {plan.deployment_id} ({removed}) on nodes {', '.join(ours) or 'none'},"
        f" released {', '.join(released) or 'none (none was still held by this run)'}"
        + (f", gave back {', '.join(handed)}" if handed else "")
        + (f"; left {', '.join(others)} to the deployment holding them" if others else "")
    )
