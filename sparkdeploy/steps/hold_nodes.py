"""Node locks: one deployment per machine, held from boot to teardown, across flow runs.

A lock is the machine's, not the inventory's name for it: two inventories may name one machine
differently, and must share its lock. The machine is known by its /etc/machine-id
(sparkdeploy.remote.node_identity, read over SSH as the deploy starts). Each machine has a Prefect
global concurrency limit `node:<machine-id prefix>` with limit 1, created on demand. A
deployment takes one slot of every node's limit in a single request (all or none, so two
deploys on overlapping nodes cannot each hold half and wait forever) and gives them back at
teardown. Who holds a machine is recorded in a Prefect Variable per machine
(`node-lock-<machine-id prefix>`, visible in the UI): the deployment, its flow run, and the
cluster and node name it took the machine by, so a waiting deploy can name the holder.

A holder that is provably gone is taken over instead of waited for: its flow run has ended
(Prefect says its state is final, or the run no longer exists) and, for another deployment, no
container of it is left on the node (asked over SSH by the caller's `containers_on`). A run of
the same deployment that has ended is a redeploy: its containers are a stale copy of this
deployment, which boot replaces. Taking over keeps the slot (it passes from the old holder to
the new) and rewrites the record, under a short per-machine mutex (`node-takeover:<machine-id
prefix>`) so two deploys never both take over one stale holder.

Leases. Prefect 3 can lease slots (they go back when the lease is not renewed in time). The node
slots are taken without one: no process lives as long as a deployment (the deploy flow run ends
while its engine serves), so a lease would need a renewer whose death, or a worker restart,
frees a node under a running engine; and Prefect keeps leases in the server's memory by default
(`PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE`), so a server restart would forget them and leak the
slots. Whether a holder is gone is proven instead, from the flow run's state and the node's
containers. The takeover mutex is leased (Prefect's minimum, 60 s): it is held for two requests,
and a deploy killed while holding it must not block takeovers of that node for good.

Arrival order. A deploy that must wait records a ticket (a Prefect Variable
`node-wait-<random>`, tagged node-wait, naming its deployment, flow run and machines); the server
stamps its creation time. A deploy takes free machines only when no live ticket created before
its own (or, before it has one, any live ticket) wants one of them, so deploys waiting for a
machine get it in the order they began to wait, and a newcomer does not overtake them. A ticket
is live while its flow run goes on and its waiter refreshes it every poll: one whose run has
ended, or which was not refreshed for TICKET_STALE_S by the server's clock, is passed over. The
waiter removes its ticket when it takes the machines or gives up.

Replacing. A deploy with `replace` names the deployments it replaces (`replacing`: holder's
deployment id -> the deployment to bring back if the new one fails); their nodes are taken over
once their own flow runs have ended, containers and all, and the new record says which
deployment it replaced (`replaces`) until the replacement is committed (commit_replacement) or
given back (give_back). A record that still says `replaces` after its flow run has ended is a
replacement that never finished (its process was killed: no rollback hook ran). It is judged by
both deployments' containers: a deploy without `replace` waits while either is on the node, and
a deploy with `replace` takes it over and inherits the deployment to bring back, so a failure
of the next attempt still rolls back to what served before the killed one.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Literal, ParamSpec, TypeVar
from uuid import UUID, uuid4

import httpx
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.actions import (
    GlobalConcurrencyLimitCreate,
    VariableCreate,
    VariableUpdate,
)
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import Variable
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from sparkdeploy.errors import NodeLockError
from sparkdeploy.remote.prefect_api import filter_variables, single_attempt_client

DEFAULT_TIMEOUT_S = 600.0
POLL_S = 1.0
# How much of the machine id names a lock: readable in the UI, and 48 bits apart.
MACHINE_PREFIX_CHARS = 12
HOLDER_TAGS = ["sparkdeploy", "node-lock"]
# Variables read per request when looking holders up by their records.
_VARIABLE_PAGE = 200
_HTTP_LOCKED = 423
_HTTP_BUSY = frozenset({429, 503})
# How long a lock call retries Prefect's busy answers, and its first wait.
API_BUSY_RETRY_S = 30.0
API_BUSY_FIRST_WAIT_S = 0.05
# Prefect refuses to release slots held for 0 s.
_MIN_OCCUPANCY_S = 0.001
# The takeover mutex's lease: Prefect's minimum; it is held for two requests.
TAKEOVER_LEASE_S = 60.0
WAIT_TAGS = ["sparkdeploy", "node-wait"]
# A wait ticket not refreshed for this long (its waiter polls every POLL_S) was left by a
# waiter that died.
TICKET_STALE_S = 60.0

_LOG = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")


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

    def taken_as(self, cluster: str, node: str) -> str:
        """How a message names the holder's own name for the machine, when it is another."""
        if (self.cluster, self.node) == (cluster, node):
            return ""
        return f" (as {self.node} of cluster {self.cluster})"


# What to do about a node's holder: it is this flow run ("ours"), provably gone ("take over"),
# or to be waited for.
Decision = Literal["ours", "take over", "wait"]
# node -> deployment ids, to whether any container of them is on that node (None: the node could
# not be asked). sparkdeploy.remote.docker_cli.deployments_present, over SSH.
ContainerCheck = Callable[[dict[str, list[str]]], dict[str, bool | None]]


def machine_label(machine_id: str) -> str:
    return machine_id[:MACHINE_PREFIX_CHARS]


def limit_name(machine_id: str) -> str:
    return f"node:{machine_label(machine_id)}"


def takeover_name(machine_id: str) -> str:
    return f"node-takeover:{machine_label(machine_id)}"


def holder_variable(machine_id: str) -> str:
    """Variable names allow lowercase letters, digits, '-' and '_': a machine id is hex."""
    return f"node-lock-{machine_label(machine_id)}"


def _current_flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    run_id = flow_run.id
    return str(run_id) if run_id else None


def _api(call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`call(*args, **kwargs)`, retried on Prefect's busy answers (429, 503) and on transport
    errors after short, growing waits. The lock calls' client sends each request once
    (sparkdeploy.remote.prefect_api.single_attempt_client), so a busy answer is retried here
    alone, not also by Prefect's client, which waits about 2 s on one even with its retries
    off."""
    deadline = time.monotonic() + API_BUSY_RETRY_S
    delay = API_BUSY_FIRST_WAIT_S
    while True:
        try:
            return call(*args, **kwargs)
        except httpx.HTTPStatusError as error:
            if error.response.status_code not in _HTTP_BUSY or time.monotonic() >= deadline:
                raise
        except httpx.TransportError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(delay * random.uniform(0.5, 1.5))
        delay = min(delay * 2, 1.0)


def _increment(
    client: SyncPrefectClient, names: Sequence[str], *, lease_s: float | None = None
) -> httpx.Response | None:
    """One slot of every named limit, all or none, creating the limits that do not exist yet,
    leased for lease_s when given; Prefect's answer, or None when one of them is full."""
    for _ in range(2):
        try:
            if lease_s is None:
                response = _api(
                    client.increment_concurrency_slots,
                    names=list(names),
                    slots=1,
                    mode="concurrency",
                )
            else:
                response = _api(
                    client.increment_concurrency_slots_with_lease,
                    names=list(names),
                    slots=1,
                    mode="concurrency",
                    lease_duration=lease_s,
                )
        except httpx.HTTPStatusError as error:
            if error.response.status_code != _HTTP_LOCKED:
                raise
            return None
        # The server skips names without a limit and takes the slots of the others.
        answer = response.json()
        limits = answer if lease_s is None else answer["limits"]
        taken = {str(limit["name"]) for limit in limits}
        missing = [name for name in names if name not in taken]
        if not missing:
            return response
        if lease_s is not None:
            _api(client.release_concurrency_slots_with_lease, UUID(answer["lease_id"]))
        elif taken:
            _api(
                client.release_concurrency_slots,
                names=sorted(taken),
                slots=1,
                occupancy_seconds=_MIN_OCCUPANCY_S,
            )
        for name in missing:
            # ObjectAlreadyExists: another deploy created it a moment ago.
            with contextlib.suppress(ObjectAlreadyExists):
                _api(
                    client.create_global_concurrency_limit,
                    GlobalConcurrencyLimitCreate(name=name, limit=1),
                )
    raise NodeLockError(f"the limits {', '.join(names)} vanish as soon as they are created")


def _take_slots(client: SyncPrefectClient, machines: Mapping[str, str]) -> bool:
    """One slot of every node's machine's limit, all or none; False when one of them is full."""
    return _increment(client, [limit_name(machine) for machine in machines.values()]) is not None


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


def ended_runs(run_ids: AbstractSet[str | None]) -> set[str | None]:
    """Those of the flow runs that are not running: final, gone, or None (no run)."""
    with single_attempt_client() as client:
        return _ended_runs(client, run_ids)


def _describe_blockers(
    client: SyncPrefectClient,
    cluster: str,
    machines: Mapping[str, str],
    why: dict[str, str],
) -> str:
    described = []
    current = _read_holders(client, machines)
    for node, machine in machines.items():
        try:
            limit = _api(client.read_global_concurrency_limit_by_name, limit_name(machine))
        except ObjectNotFound:
            continue  # never taken: the attempt that failed took no slot anywhere
        if limit.active_slots < limit.limit:
            continue
        holder = current[node]
        if holder is None:
            described.append(
                f"{node} (machine {machine_label(machine)}) is held by an unrecorded holder (a"
                " deploy taking it right now, or one that crashed while taking it: if no"
                f" deployment runs there, reset the limit `{limit_name(machine)}` to 0 active"
                " slots in the Prefect UI)"
            )
        else:
            run = f", flow run {holder.flow_run_id}" if holder.flow_run_id else ""
            reason = f" ({why[node]})" if node in why else ""
            described.append(
                f"{node} is held by deployment {holder.deployment_id}"
                f"{holder.taken_as(cluster, node)} since {holder.since}{run}{reason}"
            )
    return "; ".join(described) or "the nodes were released while this deploy was giving up"


def holder_decision(
    holder: NodeHolder,
    deployment_id: str,
    flow_run_id: str | None,
    *,
    run_ended: bool,
    containers_left: bool | None,
    replacing: bool = False,
) -> Decision:
    """What a deploy of `deployment_id` in flow run `flow_run_id` does about a node's holder.

    `run_ended`: the holder's flow run is final or gone (a holder recorded outside any flow run
    counts as ended: no run of it can still be going). `containers_left`: whether the holder's
    deployment (and, for an unfinished replacement, the deployment it replaced) has a container
    on the node (None: the node could not be asked; only consulted for another deployment).
    `replacing`: the deploy replaces the holder's deployment. A holder is taken over only when
    its run has ended and it is replaced, is this deployment, or has nothing left on the node. A
    run that is still going (a concurrent deploy, of this deployment or another) is waited for.
    """
    if holder.deployment_id == deployment_id and holder.flow_run_id == flow_run_id:
        return "ours"
    if not run_ended:
        return "wait"
    if replacing or holder.deployment_id == deployment_id:
        return "take over"  # boot replaces what is left of it
    return "take over" if containers_left is False else "wait"


def unfinished_replacement(holder: NodeHolder, run_ended: bool) -> Replaced | None:
    """The deployment a holder was replacing when its flow run ended without committing or
    giving the node back (its process was killed), else None."""
    return holder.replaces if run_ended else None


def _ended_runs(client: SyncPrefectClient, run_ids: AbstractSet[str | None]) -> set[str | None]:
    """Those of the flow runs that are not running: final, gone, or None (no run), in one
    request."""
    ids = {}
    for run_id in run_ids:
        with contextlib.suppress(ValueError, TypeError):
            ids[UUID(str(run_id))] = run_id
    if not ids:
        return set(run_ids)
    runs = _api(
        client.read_flow_runs,
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(ids))),
        limit=len(ids),
    )
    live = {str(run.id) for run in runs if run.state is not None and not run.state.is_final()}
    return {run_id for run_id in run_ids if run_id not in live}


def _decide(
    client: SyncPrefectClient,
    current: dict[str, NodeHolder | None],
    deployment_id: str,
    flow_run_id: str | None,
    containers_on: ContainerCheck | None,
    replacing: Mapping[str, Replaced],
) -> tuple[dict[str, Decision], dict[str, str]]:
    """A decision for every held node, and why each node to wait for is waited for."""
    held = {node: holder for node, holder in current.items() if holder is not None}
    others = {
        node: holder
        for node, holder in held.items()
        if holder.deployment_id != deployment_id or holder.flow_run_id != flow_run_id
    }
    ended = (
        _ended_runs(client, {holder.flow_run_id for holder in others.values()}) if others else set()
    )
    # Only another deployment whose run has ended is worth the SSH round trip; an unfinished
    # replacement is judged by the containers of both deployments.
    to_ask: dict[str, list[str]] = {}
    for node, holder in others.items():
        if holder.flow_run_id not in ended or holder.deployment_id in replacing:
            continue
        unfinished = unfinished_replacement(holder, run_ended=True)
        ids = {holder.deployment_id, *([unfinished.deployment_id] if unfinished else [])}
        ids.discard(deployment_id)
        if ids:
            to_ask[node] = sorted(ids)
    left: dict[str, bool | None] = dict.fromkeys(to_ask)
    if to_ask and containers_on is not None:
        left.update(containers_on(to_ask))
    decisions: dict[str, Decision] = {}
    why: dict[str, str] = {}
    for node, holder in held.items():
        run_ended = holder.flow_run_id in ended
        decisions[node] = holder_decision(
            holder,
            deployment_id,
            flow_run_id,
            run_ended=run_ended,
            containers_left=left.get(node, False),
            replacing=holder.deployment_id in replacing,
        )
        if decisions[node] != "wait":
            continue
        unfinished = unfinished_replacement(holder, run_ended)
        if not run_ended:
            why[node] = "its flow run is still going"
        elif left.get(node) is None:
            why[node] = (
                f"its flow run has ended; whether its containers are gone from {node} is unknown"
            )
        elif unfinished is not None:
            why[node] = (
                f"its flow run ended while it was replacing deployment"
                f" {unfinished.deployment_id} ({unfinished.recipe}), and containers of one of"
                f" them are still on {node}: deploy with replace=true (a failure then brings"
                f" {unfinished.deployment_id} back) or tear them down"
            )
        else:
            why[node] = (
                f"its flow run has ended but its containers are still on {node}: tear that"
                " deployment down, or deploy with replace=true"
            )
    return decisions, why


def _take_over(
    client: SyncPrefectClient,
    cluster: str,
    stale: dict[str, NodeHolder],
    deployment_id: str,
    flow_run_id: str | None,
    replacing: Mapping[str, Replaced],
    *,
    log: Callable[[str], None],
    warn: Callable[[str], None],
) -> list[str]:
    """The stale holders' nodes recorded as this run's, under their takeover mutex; the nodes
    taken over (none while another deploy is taking them over)."""
    names = [takeover_name(holder.machine_id) for holder in stale.values()]
    response = _increment(client, names, lease_s=TAKEOVER_LEASE_S)
    if response is None:
        return []
    taken = []
    try:
        # Re-read under the mutex: another deploy may have taken over (or the holder let go)
        # since the decision.
        now = _read_holders(client, {node: holder.machine_id for node, holder in stale.items()})
        since = datetime.now(UTC).isoformat(timespec="seconds")
        for node, holder in stale.items():
            if now[node] != holder:
                continue
            same = holder.deployment_id == deployment_id
            replaced = replacing.get(holder.deployment_id)
            _write_holder(
                client,
                NodeHolder(
                    node,
                    deployment_id,
                    holder.since if same else since,
                    flow_run_id,
                    cluster,
                    holder.machine_id,
                    replaced,
                ),
            )
            taken.append(node)
            run = f"flow run {holder.flow_run_id}" if holder.flow_run_id else "no flow run"
            if replaced is not None:
                brought_back = (
                    f"; {replaced.deployment_id} comes back if this deployment fails"
                    if replaced.deployment_id != deployment_id
                    else ""
                )
                warn(
                    f"node {node} of cluster {cluster}: replacing deployment"
                    f" {holder.deployment_id}{holder.taken_as(cluster, node)} (holder since"
                    f" {holder.since}, {run} has ended){brought_back}"
                )
            elif same:
                log(f"node {node}: deployment {deployment_id} goes on holding it ({run} has ended)")
            else:
                warn(
                    f"node {node} of cluster {cluster}: taking it over from deployment"
                    f" {holder.deployment_id}{holder.taken_as(cluster, node)} (holder since"
                    f" {holder.since}, {run}): its flow run has ended and none of its containers"
                    " is left on the node"
                )
    finally:
        _api(client.release_concurrency_slots_with_lease, UUID(response.json()["lease_id"]))
    return taken


def acquire_nodes(
    cluster: str,
    machines: Mapping[str, str],
    deployment_id: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    poll_s: float = POLL_S,
    containers_on: ContainerCheck | None = None,
    replacing: Mapping[str, Replaced] | None = None,
    log: Callable[[str], None] = _LOG.info,
    warn: Callable[[str], None] = _LOG.warning,
) -> list[str]:
    """Hold every node for `deployment_id`, waiting up to timeout_s for another to let go.

    `machines`: node -> its machine id (sparkdeploy.remote.node_identity.machine_ids), in rank
    order; the lock taken is the machine's, so a deployment of another inventory naming the same
    machine is waited for like any other. Idempotent for one deployment: nodes it already holds
    are kept (and recorded as held by this flow run), unless another flow run of it is still
    going. A holder provably gone is
    taken over with a warning naming it (module docstring); without `containers_on` another
    deployment's holder is never proven gone. A holder whose deployment is in `replacing` is
    taken over once its flow run has ended, recording the Replaced it maps to. Returns the
    nodes newly taken (those taken over from another deployment or for a replacement
    included). Raises NodeLockError naming the holders when the wait runs out.
    """
    replacing = replacing or {}
    deadline = time.monotonic() + timeout_s
    waited_for: str | None = None
    flow_run_id = _current_flow_run_id()
    taken_over: list[str] = []
    nodes = list(machines)
    ticket: str | None = None
    with single_attempt_client() as client:
        try:
            while True:
                current = _read_holders(client, machines)
                decisions, why = _decide(
                    client, current, deployment_id, flow_run_id, containers_on, replacing
                )
                stale = {
                    node: holder
                    for node, holder in current.items()
                    if holder is not None and decisions[node] == "take over"
                }
                if stale:
                    done = _take_over(
                        client,
                        cluster,
                        stale,
                        deployment_id,
                        flow_run_id,
                        replacing,
                        log=log,
                        warn=warn,
                    )
                    # Newly this run's, to give back on failure: those of other deployments, and
                    # those of this one that a replacement would hand back.
                    taken_over += [
                        node
                        for node in done
                        if stale[node].deployment_id != deployment_id
                        or stale[node].deployment_id in replacing
                    ]
                    if done:
                        continue  # they are this run's now: decide again from the new records
                    why.update(dict.fromkeys(stale, "another deploy is taking it over right now"))
                wanted = [node for node in nodes if decisions.get(node) != "ours"]
                busy = [node for node in wanted if current[node] is not None]
                ahead = _ahead(client, ticket, _of(machines, wanted)) if wanted else []
                # Free, nobody ahead: take them, unless another deploy just did.
                if (
                    wanted
                    and not busy
                    and not ahead
                    and not _take_slots(client, _of(machines, wanted))
                ):
                    busy = wanted
                if busy or ahead:
                    ticket = _queue(
                        client, ticket, deployment_id, flow_run_id, _of(machines, wanted)
                    )
                    blockers = "; ".join(
                        (
                            [_describe_blockers(client, cluster, _of(machines, busy), why)]
                            if busy
                            else []
                        )
                        + [found.describe(_of(machines, wanted)) for found in ahead]
                    )
                    if time.monotonic() >= deadline:
                        raise NodeLockError(
                            f"deployment {deployment_id} could not take nodes"
                            f" {', '.join(wanted)} of cluster {cluster} within"
                            f" {timeout_s:.0f} s: {blockers}. Wait for that flow run, tear that"
                            " deployment down (the teardown flow) or choose other nodes"
                        )
                    if blockers != waited_for:
                        log(f"waiting for nodes of cluster {cluster}: {blockers}")
                        waited_for = blockers
                    time.sleep(poll_s)
                    continue
                since = datetime.now(UTC).isoformat(timespec="seconds")
                for node in wanted:
                    _write_holder(
                        client,
                        NodeHolder(
                            node, deployment_id, since, flow_run_id, cluster, machines[node]
                        ),
                    )
                if wanted:
                    held = ", ".join(
                        f"{node} (machine {machine_label(machines[node])})" for node in wanted
                    )
                    log(f"deployment {deployment_id} holds {held} of cluster {cluster}")
                return [node for node in nodes if node in wanted or node in taken_over]
        finally:
            if ticket is not None:
                with contextlib.suppress(ObjectNotFound):
                    _api(client.delete_variable_by_name, ticket)


@dataclass(frozen=True)
class WaitTicket:
    """A deploy waiting for machines, as its ticket records it."""

    name: str
    deployment_id: str
    flow_run_id: str | None
    machines: frozenset[str]
    created: datetime
    updated: datetime

    @classmethod
    def of(cls, variable: Variable) -> WaitTicket | None:
        value = variable.value
        if not isinstance(value, dict) or not isinstance(value.get("machines"), list):
            return None
        if variable.created is None or variable.updated is None:
            return None
        return cls(
            name=variable.name,
            deployment_id=str(value.get("deployment_id")),
            flow_run_id=value.get("flow_run_id"),
            machines=frozenset(str(machine) for machine in value["machines"]),
            created=variable.created,
            updated=variable.updated,
        )

    def describe(self, machines: Mapping[str, str]) -> str:
        nodes = [node for node, machine in machines.items() if machine in self.machines]
        run = f", flow run {self.flow_run_id}" if self.flow_run_id else ""
        return (
            f"{', '.join(nodes)}: deployment {self.deployment_id}{run} has waited for"
            f" {'it' if len(nodes) == 1 else 'them'} since"
            f" {self.created.isoformat(timespec='seconds')} and goes first"
        )


def _wait_tickets(client: SyncPrefectClient) -> list[WaitTicket]:
    found: list[WaitTicket] = []
    while True:
        page = _api(
            filter_variables, client, tags=WAIT_TAGS, limit=_VARIABLE_PAGE, offset=len(found)
        )
        found += [ticket for ticket in map(WaitTicket.of, page) if ticket is not None]
        if len(page) < _VARIABLE_PAGE:
            return found


def _queue(
    client: SyncPrefectClient,
    ticket: str | None,
    deployment_id: str,
    flow_run_id: str | None,
    machines: Mapping[str, str],
) -> str:
    """This deploy's ticket for `machines`, created or refreshed (which moves its updated
    time, not its place); its name."""
    value = {
        "deployment_id": deployment_id,
        "flow_run_id": flow_run_id,
        "machines": sorted(machines.values()),
        "refreshed": time.time(),
    }
    if ticket is None:
        ticket = f"node-wait-{uuid4().hex}"
        _api(client.create_variable, VariableCreate(name=ticket, value=value, tags=WAIT_TAGS))
    else:
        _api(client.update_variable, VariableUpdate(name=ticket, value=value, tags=WAIT_TAGS))
    return ticket


def _ahead(
    client: SyncPrefectClient, ticket: str | None, machines: Mapping[str, str]
) -> list[WaitTicket]:
    """The live tickets for any of `machines` that came before this deploy's own `ticket` (all
    of them when it has none yet)."""
    tickets = _wait_tickets(client)
    own = next((found for found in tickets if found.name == ticket), None)
    wanted = set(machines.values())
    others = [found for found in tickets if found.name != ticket and found.machines & wanted]
    if own is not None:
        others = [
            found
            for found in others
            if (found.created, found.name) < (own.created, own.name)
            and (own.updated - found.updated).total_seconds() <= TICKET_STALE_S
        ]
    if not others:
        return []
    ended = _ended_runs(client, {found.flow_run_id for found in others if found.flow_run_id})
    return [
        found for found in others if found.flow_run_id is None or found.flow_run_id not in ended
    ]


def _of(machines: Mapping[str, str], nodes: Sequence[str]) -> dict[str, str]:
    return {node: machines[node] for node in nodes}


def give_back(
    cluster: str,
    nodes: Sequence[str],
    deployment_id: str,
    *,
    flow_run_id: str | None = None,
    log: Callable[[str], None] = _LOG.info,
) -> dict[str, str | None]:
    """Undo a deploy's hold: each of the nodes (as the cluster names them) `deployment_id` holds
    in flow run `flow_run_id` (default: the current one) goes back to the deployment its record
    says it replaced, held by that flow run, or is released. Returns node -> the deployment now
    holding it (None: released). Idempotent."""
    run_id = flow_run_id or _current_flow_run_id()
    given: dict[str, str | None] = {}
    wanted = set(nodes)
    with single_attempt_client() as client:
        for holder in _recorded_holders(client):
            if (
                holder.cluster != cluster
                or holder.node not in wanted
                or (holder.deployment_id, holder.flow_run_id) != (deployment_id, run_id)
            ):
                continue
            back = holder.replaces
            if back is None or back.deployment_id == deployment_id:
                given[holder.node] = None
                continue
            _write_holder(
                client,
                NodeHolder(
                    holder.node, back.deployment_id, back.since, run_id, cluster, holder.machine_id
                ),
            )
            given[holder.node] = back.deployment_id
    released = [node for node, to in given.items() if to is None]
    if released:
        release_nodes(cluster, released, deployment_id, log=log)
    for node, to in given.items():
        if to is not None:
            log(f"node {node}: deployment {deployment_id} gave it back to deployment {to}")
    return given


def commit_replacement(
    cluster: str,
    nodes: Sequence[str],
    deployment_id: str,
    replaced: Sequence[Replaced],
    *,
    log: Callable[[str], None] = _LOG.info,
) -> list[str]:
    """A replacement that succeeded: its records on the nodes no longer name what they replaced,
    and the replaced deployments let go of the nodes they still hold. Returns the nodes let
    go."""
    wanted = set(nodes)
    with single_attempt_client() as client:
        for holder in _recorded_holders(client):
            if (
                holder.cluster == cluster
                and holder.node in wanted
                and holder.deployment_id == deployment_id
                and holder.replaces is not None
            ):
                _write_holder(client, replace(holder, replaces=None))
    let_go = []
    for old in replaced:
        let_go += release_nodes(cluster, old.nodes, old.deployment_id, log=log)
    if replaced:
        log(
            f"deployment {deployment_id} replaced "
            + ", ".join(old.deployment_id for old in replaced)
        )
    return let_go


def release_nodes(
    cluster: str,
    nodes: Sequence[str],
    deployment_id: str,
    *,
    log: Callable[[str], None] = _LOG.info,
) -> list[str]:
    """Give back the nodes, as the cluster names them, that `deployment_id` holds; others'
    nodes stay as they are. Idempotent. Found by the holder records (no node is asked: a node
    that is down is let go too).

    The holder record goes first: a crash in between leaves a node locked by an unrecorded
    holder (safe, and named as such) rather than free with a stale record.
    """
    released = []
    wanted = set(nodes)
    with single_attempt_client() as client:
        held_since: dict[str, list[str]] = {}
        for holder in _recorded_holders(client):
            if (
                holder.cluster != cluster
                or holder.node not in wanted
                or holder.deployment_id != deployment_id
            ):
                continue
            _api(client.delete_variable_by_name, holder_variable(holder.machine_id))
            held_since.setdefault(holder.since, []).append(holder.machine_id)
            released.append(holder.node)
        for since, held in held_since.items():
            names = [limit_name(machine) for machine in held]
            _api(
                client.release_concurrency_slots,
                names=names,
                slots=1,
                occupancy_seconds=_held_seconds(since),
            )
    released = [node for node in nodes if node in released]
    if released:
        log(f"deployment {deployment_id} released {', '.join(released)} of cluster {cluster}")
    return released


def _held_seconds(since_iso: str) -> float:
    try:
        since = datetime.fromisoformat(since_iso)
    except ValueError:
        return _MIN_OCCUPANCY_S
    return max(_MIN_OCCUPANCY_S, (datetime.now(UTC) - since).total_seconds())
