"""What the Prefect server records about a machine's lock: the names of its limit, takeover
mutex and holder Variable, and the holder that Variable names (NodeHolder), read and written."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.actions import VariableCreate, VariableUpdate
from prefect.client.schemas.objects import Variable
from prefect.exceptions import ObjectAlreadyExists

from sparkdeploy.remote.prefect_api import filter_variables, single_attempt_client
from sparkdeploy.steps.hold_nodes.api import _VARIABLE_PAGE, _api

# How much of the machine id names a lock: readable in the UI, and 48 bits apart.
MACHINE_PREFIX_CHARS = 12
HOLDER_TAGS = ["sparkdeploy", "node-lock"]


@dataclass(frozen=True)
class Replaced:
    """A deployment a replacement took nodes from: enough to plan it again and hand them back."""

    deployment_id: str
    recipe: str  # a recipe name under recipes/
    nodes: tuple[str, ...]  # in rank order
    since: str  # when it first held its nodes, ISO 8601, UTC

    def as_json(self) -> dict[str, Any]:
        return {
            "deployment_id": self.deployment_id,
            "recipe": self.recipe,
            "nodes": list(self.nodes),
            "since": self.since,
        }

    @classmethod
    def from_json(cls, value: Any) -> Replaced | None:
        if not isinstance(value, dict):
            return None
        nodes = value.get("nodes")
        return cls(
            deployment_id=str(value.get("deployment_id")),
            recipe=str(value.get("recipe")),
            nodes=tuple(str(node) for node in nodes) if isinstance(nodes, list) else (),
            since=str(value.get("since")),
        )


@dataclass(frozen=True)
class NodeHolder:
    """Who holds a machine, and by which name: `cluster` and `node` are the inventory and node
    name the holder took it by (another inventory may name the machine otherwise)."""

    node: str
    deployment_id: str
    since: str  # ISO 8601, UTC
    flow_run_id: str | None
    cluster: str
    machine_id: str
    # The deployment this one replaced and would hand the node back to, until committed.
    replaces: Replaced | None = None
    # The ended flow run of this same deployment whose hold this run took over (a redeploy):
    # while that run's containers still serve, a cancelled or crashed redeploy hands the node
    # back to it instead of releasing it.
    took_over_from: str | None = None

    def taken_as(self, cluster: str, node: str) -> str:
        """How a message names the holder's own name for the machine, when it is another."""
        if (self.cluster, self.node) == (cluster, node):
            return ""
        return f" (as {self.node} of cluster {self.cluster})"


def machine_label(machine_id: str) -> str:
    return machine_id[:MACHINE_PREFIX_CHARS]


def limit_name(machine_id: str) -> str:
    return f"node:{machine_label(machine_id)}"


def takeover_name(machine_id: str) -> str:
    return f"node-takeover:{machine_label(machine_id)}"


def holder_variable(machine_id: str) -> str:
    """Variable names allow lowercase letters, digits, '-' and '_': a machine id is hex."""
    return f"node-lock-{machine_label(machine_id)}"


def _holder_of(variable: Variable) -> NodeHolder | None:
    """The holder a lock variable records; None for what is no record of this version's (a
    record without a machine id was keyed by node name, before the locks were per machine)."""
    value = variable.value
    if not isinstance(value, dict) or not isinstance(value.get("machine_id"), str):
        return None
    return NodeHolder(
        node=str(value.get("node")),
        deployment_id=str(value.get("deployment_id")),
        since=str(value.get("since")),
        flow_run_id=value.get("flow_run_id"),
        cluster=str(value.get("cluster")),
        machine_id=value["machine_id"],
        replaces=Replaced.from_json(value.get("replaces")),
        took_over_from=(
            value["took_over_from"] if isinstance(value.get("took_over_from"), str) else None
        ),
    )


def _read_holders(
    client: SyncPrefectClient, machines: Mapping[str, str]
) -> dict[str, NodeHolder | None]:
    """node -> the holder of its machine (machines: node -> machine id), in one request."""
    by_variable = {holder_variable(machine): node for node, machine in machines.items()}
    variables = _api(filter_variables, client, names=list(by_variable), limit=len(by_variable))
    found: dict[str, NodeHolder | None] = dict.fromkeys(machines)
    for variable in variables:
        node = by_variable.get(variable.name)
        if node is not None:
            found[node] = _holder_of(variable)
    return found


def _recorded_holders(client: SyncPrefectClient) -> list[NodeHolder]:
    """Every holder record there is (one per held machine), a page of variables a request."""
    found: list[NodeHolder] = []
    offset = 0
    while True:
        page = _api(filter_variables, client, tags=HOLDER_TAGS, limit=_VARIABLE_PAGE, offset=offset)
        found += [holder for holder in map(_holder_of, page) if holder is not None]
        if len(page) < _VARIABLE_PAGE:
            return found
        offset += len(page)


def _write_holder(client: SyncPrefectClient, holder: NodeHolder) -> None:
    name = holder_variable(holder.machine_id)
    value = {
        "deployment_id": holder.deployment_id,
        "since": holder.since,
        "flow_run_id": holder.flow_run_id,
        "cluster": holder.cluster,
        "node": holder.node,
        "machine_id": holder.machine_id,
        # Only while a replacement is under way: a plain holder's record stays as it was.
        **({"replaces": holder.replaces.as_json()} if holder.replaces else {}),
        **({"took_over_from": holder.took_over_from} if holder.took_over_from else {}),
    }
    try:
        _api(client.create_variable, VariableCreate(name=name, value=value, tags=HOLDER_TAGS))
    except ObjectAlreadyExists:
        _api(client.update_variable, VariableUpdate(name=name, value=value, tags=HOLDER_TAGS))


def holders(cluster: str, nodes: Sequence[str]) -> dict[str, NodeHolder | None]:
    """Who holds each node as the cluster names it, from the holders' records (None: no
    deployment took it by this name, or one is taking it and has not recorded itself yet).

    For the steps after hold-nodes and for teardown, which ask about the nodes their own
    deployment took; hold-nodes asks about machines (acquire_nodes). A machine whose record
    outlived it (reinstalled with a new id while held) may leave a second record under the same
    name: the newest counts.
    """
    wanted = set(nodes)
    found: dict[str, NodeHolder | None] = dict.fromkeys(nodes)
    with single_attempt_client() as client:
        for holder in _recorded_holders(client):
            if holder.cluster != cluster or holder.node not in wanted:
                continue
            known = found[holder.node]
            if known is None or holder.since > known.since:
                found[holder.node] = holder
    return found
