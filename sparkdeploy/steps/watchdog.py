"""Why a deployment that was ready stopped serving: the smoke watchdog's diagnosis.

Real vLLM does not notice a dead worker: the head's /health stays 200 until a request reaches
the dead rank; then it logs gloo's "Connection closed by peer [ip]:port", EngineDeadError, and
exits with status 0. So the watchdog's real requests are what find it, and this module names the
cause from what the nodes still show: each container's state (an exited one names its node and
exit code) and the head's log (the fatal line, the worker its peer address belongs to). A head
that exited, with any status, before a teardown is a failure, never a clean stop.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from sparkdeploy.errors import DeploymentDown
from sparkdeploy.remote.docker_cli import ContainerInfo, container_log, list_containers, on_nodes
from sparkdeploy.remote.runner import Runner
from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.spec.labels import DEPLOYMENT_LABEL
from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.hold_nodes import NodeHolder
from sparkdeploy.steps.status import DeploymentStatus
from sparkdeploy.vllm.log_lines import classify_log, strip_log_prefix
from sparkdeploy.vllm.markers import FAILURE_HINTS

LOG_TIMEOUT_S = 60.0
EXCERPT_LINES = 12


@dataclass(frozen=True)
class NodeState:
    node: str
    container: ContainerInfo | None  # None: the deployment has no container there
    log_lines: list[str]  # the head's whole log; empty for workers


def _docker_timestamp_removed(line: str) -> str:
    stamp, _, rest = line.partition(" ")
    return rest if stamp[:4].isdigit() and stamp.endswith("Z") else line


def node_states(plan: Plan) -> dict[str, NodeState]:
    """Each node's container of the deployment and, for the head, its log: one round trip."""
    head = plan.head.node
    label = f"{DEPLOYMENT_LABEL}={plan.deployment_id}"

    def state(runner: Runner, node: str) -> NodeState:
        containers = list_containers(runner, node, label)
        container = containers[0] if containers else None
        lines: list[str] = []
        if node == head and container is not None:
            text = container_log(runner, node, container.id, timeout=LOG_TIMEOUT_S)
            lines = [_docker_timestamp_removed(line) for line in text.splitlines()]
        return NodeState(node, container, lines)

    return on_nodes(plan_targets(plan), state)


def _state_text(container: ContainerInfo | None) -> str:
    if container is None:
        return "has no container of the deployment (removed by hand?)"
    if container.status == "exited":
        return f"exited with code {container.exit_code}"
    return container.status


def diagnose(plan: Plan, states: dict[str, NodeState]) -> DeploymentDown | None:
    """The named reason the deployment is down, or None when every container runs and the
    head's log holds no fatal line (then the smoke report's own evidence is all there is)."""
    head = plan.head.node
    node_of_ip = {node.fabric_ip: node.node for node in plan.nodes}
    found = classify_log(
        states[head].log_lines,
        node=head,
        node_of_ip=node_of_ip,
        failure_markers=plan.failure_markers,
    )
    stopped = {
        name: _state_text(state.container)
        for name, state in states.items()
        if state.container is None or state.container.status != "running"
    }
    if found is None and not stopped:
        return None
    workers_stopped = [name for name in stopped if name != head]
    if found is not None and found.node != head:
        node, kind = found.node, found.kind
    elif workers_stopped:
        node, kind = workers_stopped[0], "worker_died"
    elif found is not None:
        node, kind = head, found.kind
    else:
        node, kind = head, "head_exited"
    causes = [f"{name} {text}" for name, text in stopped.items()]
    if head in stopped:
        causes.append(f"the head ({head}) stopped before any teardown: a failure, not a clean stop")
    if found is not None:
        causes.insert(0, found.cause)
    cause = "; ".join(causes)
    excerpt = found.excerpt if found is not None else states[head].log_lines[-EXCERPT_LINES:]
    quoted = "\n".join(f"  | {strip_log_prefix(line) or line}" for line in excerpt)
    hint = FAILURE_HINTS.get(kind, FAILURE_HINTS["container_exited"])
    message = (
        f"deployment {plan.deployment_id} ({plan.recipe}) is down: {node}: {cause}\n"
        f"log of the head {head}:\n{quoted}\nfix: {hint}"
    )
    return DeploymentDown(message, node=node, kind=kind, cause=cause, excerpt=list(excerpt))


def being_deployed(
    status: DeploymentStatus,
    holders: Mapping[str, NodeHolder | None],
    live_runs: AbstractSet[str | None],
) -> str | None:
    """Why the watchdog leaves a deployment alone this time: a deploy (a repair, a replacement,
    a scheduled ensure) whose flow run is still going holds one of its nodes, and judging it
    mid-boot would raise a false alarm (and a second repair). None: it is the watchdog's."""
    for node in status.nodes:
        holder = holders.get(node)
        if holder is not None and holder.flow_run_id in live_runs:
            return (
                f"{node} is held by flow run {holder.flow_run_id} (deploying"
                f" {holder.deployment_id}), still going"
            )
    return None
