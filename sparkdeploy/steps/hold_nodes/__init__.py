"""Node locks: one deployment per machine, held from boot to teardown, across flow runs.

A lock is the machine's, not the inventory's name for it: two inventories may name one machine
differently, and must share its lock. The machine is known by its /etc/machine-id
(sparkdeploy.remote.node_identity, read over SSH as the deploy starts). Each machine has a Prefect
global concurrency limit `node:<machine-id prefix>` with limit 1, created on demand. A
deployment takes one slot of every node's limit in a single request (all or none, so two
deploys on overlapping nodes cannot each hold half and wait forever) and gives them back at
teardown. Who holds a machine is recorded in a Prefect Variable per machine
(`node-lock-<machine-id prefix>`, visible in the UI): the deployment, its flow run, and the
cluster and node name it took the machine by, so a waiting deploy can name the holder. The
slots come first, then the records; a failure or cancel in between gives back the slots just
taken and deletes the records written, since an unrecorded holder would be waited on by every
later deploy.

A holder that is provably gone is taken over instead of waited for: its flow run has ended
(Prefect says its state is final, or the run no longer exists) and, for another deployment, no
container of it is left on the node (asked over SSH by the caller's `containers_on`). A run of
the same deployment that has ended is a redeploy: its containers are a stale copy of this
deployment, which boot replaces. The redeploy's record keeps the run it took over from
(`took_over_from`): a redeploy that fails, is cancelled or crashes before its boot replaced that
copy hands the node back to that run (hand_back_to_serving), so the hold names the run whose
containers serve. Taking over keeps the slot (it passes from the old holder to
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

One module per job:
  __init__.py   acquire_nodes, give_back, commit_replacement, release_nodes: the step's API
  records.py    the lock's names on the server; the holder records (NodeHolder, Replaced)
  decisions.py  ours, take over or wait, for each held node, and why it is waited for
  takeover.py   holders provably gone taken over, under the takeover mutex
  queue.py      the wait tickets that keep arrival order
  slots.py      the global concurrency limits' slots, taken all or none and given back
  runs.py       which flow runs have ended
  api.py        Prefect's busy answers retried on our own, short schedule
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime

from prefect.client.orchestration import SyncPrefectClient
from prefect.exceptions import ObjectNotFound

from sparkdeploy.errors import NodeLockError
from sparkdeploy.remote.prefect_api import single_attempt_client
from sparkdeploy.steps.hold_nodes.api import _api
from sparkdeploy.steps.hold_nodes.decisions import (
    ContainerCheck,
    _decide,
    _describe_blockers,
    holder_decision,
    unfinished_replacement,
)
from sparkdeploy.steps.hold_nodes.queue import _ahead, _queue
from sparkdeploy.steps.hold_nodes.records import (
    NodeHolder,
    Replaced,
    _read_holders,
    _recorded_holders,
    _write_holder,
    holder_variable,
    holders,
    limit_name,
    machine_label,
)
from sparkdeploy.steps.hold_nodes.runs import ended_runs
from sparkdeploy.steps.hold_nodes.slots import _give_back_slots, _take_slots
from sparkdeploy.steps.hold_nodes.takeover import _take_over

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "POLL_S",
    "ContainerCheck",
    "NodeHolder",
    "Replaced",
    "acquire_nodes",
    "commit_replacement",
    "ended_runs",
    "give_back",
    "hand_back_to_serving",
    "holder_decision",
    "holder_variable",
    "holders",
    "limit_name",
    "release_nodes",
    "unfinished_replacement",
]

DEFAULT_TIMEOUT_S = 600.0
POLL_S = 1.0
# How often each part of undoing a hold that could not be recorded is tried (each request also
# retried on busy answers by _api).
_UNDO_ATTEMPTS = 3

_LOG = logging.getLogger(__name__)


def _current_flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    run_id = flow_run.id
    return str(run_id) if run_id else None


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
                _record_or_give_back(
                    client,
                    [
                        NodeHolder(node, deployment_id, since, flow_run_id, cluster, machines[node])
                        for node in wanted
                    ],
                    warn=warn,
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


def _of(machines: Mapping[str, str], nodes: Sequence[str]) -> dict[str, str]:
    return {node: machines[node] for node in nodes}


def _record_or_give_back(
    client: SyncPrefectClient, taken: Sequence[NodeHolder], *, warn: Callable[[str], None]
) -> None:
    """Record the holders of the machines whose slots this attempt has just taken.

    A failure in between (an API error, or a cancel or interrupt: any BaseException) would leave
    the slots taken with no record: an unrecorded holder every later deploy waits on and none
    can name or take over. So the records this attempt wrote are deleted and exactly its slots
    given back before the failure goes on. Records are not written before the slots instead: a
    record whose slot another deploy took would name the wrong holder to its waiters.
    """
    try:
        for holder in taken:
            _write_holder(client, holder)
    except BaseException:
        _undo_hold(client, taken, warn=warn)
        raise


def _undo_hold(
    client: SyncPrefectClient, taken: Sequence[NodeHolder], *, warn: Callable[[str], None]
) -> None:
    """Delete the records of `taken` (one attempt's holders: one deployment, run and since) that
    reached the server, then give back their slots; each part tried _UNDO_ATTEMPTS times, since
    what it fails to undo blocks the machines until a person resets them."""
    machines = {holder.node: holder.machine_id for holder in taken}
    since = taken[0].since

    def delete_records() -> None:
        for node, recorded in _read_holders(client, machines).items():
            # Only this attempt's own: a record, even one whose answer was lost, equals it.
            if recorded is not None and recorded in taken:
                with contextlib.suppress(ObjectNotFound):
                    _api(client.delete_variable_by_name, holder_variable(machines[node]))

    # Records first, as release_nodes does: a node never looks free under a stale record.
    for part, undo in (
        ("delete the holder records", delete_records),
        ("give back the slots", lambda: _give_back_slots(client, list(machines.values()), since)),
    ):
        for attempt in range(1, _UNDO_ATTEMPTS + 1):
            try:
                undo()
                break
            except Exception as error:
                if attempt < _UNDO_ATTEMPTS:
                    continue
                limits = ", ".join(f"`{limit_name(machine)}`" for machine in machines.values())
                warn(
                    f"deployment {taken[0].deployment_id} took the node locks of"
                    f" {', '.join(machines)} of cluster {taken[0].cluster} but failed to record"
                    f" them, and could not {part} after {_UNDO_ATTEMPTS} attempts ({error}):"
                    f" reset the limits {limits} to 0 active slots (`prefect gcl update NAME"
                    " --active-slots 0`) and delete their `node-lock-*` variables in the Prefect"
                    " UI once no deploy is under way there"
                )
                return


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


def hand_back_to_serving(
    cluster: str,
    serving: Sequence[str],
    deployment_id: str,
    *,
    flow_run_id: str | None = None,
    log: Callable[[str], None] = _LOG.info,
) -> list[str]:
    """Undo a redeploy's takeover where the copy it was to replace still serves: each node of
    `serving` (as the cluster names them: nodes where containers of `deployment_id` not started
    by this run are still up) whose record says flow run `flow_run_id` (default: the current
    one) took it over from an earlier run of the same deployment goes back to that run, its
    `since` unchanged. Returns the nodes handed back. Idempotent."""
    run_id = flow_run_id or _current_flow_run_id()
    wanted = set(serving)
    back = []
    with single_attempt_client() as client:
        for holder in _recorded_holders(client):
            if (
                holder.cluster == cluster
                and holder.node in wanted
                and (holder.deployment_id, holder.flow_run_id) == (deployment_id, run_id)
                and holder.took_over_from is not None
                and holder.replaces is None
            ):
                _write_holder(
                    client,
                    replace(holder, flow_run_id=holder.took_over_from, took_over_from=None),
                )
                back.append(holder.node)
                log(
                    f"node {holder.node}: {deployment_id} still serves there; its hold goes back"
                    f" to flow run {holder.took_over_from}, whose hold this run took over"
                )
    return [node for node in serving if node in back]


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
            _give_back_slots(client, held, since)
    released = [node for node in nodes if node in released]
    if released:
        log(f"deployment {deployment_id} released {', '.join(released)} of cluster {cluster}")
    return released
