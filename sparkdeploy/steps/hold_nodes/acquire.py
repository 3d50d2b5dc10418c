"""acquire_nodes: every node of a deployment held, holders provably gone taken over, the others
waited for in arrival order (the package docstring); the slots it takes recorded, or given back."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from prefect.client.orchestration import SyncPrefectClient
from prefect.exceptions import ObjectNotFound

from sparkdeploy.errors import NodeLockError
from sparkdeploy.remote.prefect_api import single_attempt_client
from sparkdeploy.steps.hold_nodes.api import _api
from sparkdeploy.steps.hold_nodes.decisions import ContainerCheck, _decide, _describe_blockers
from sparkdeploy.steps.hold_nodes.queue import WaitTicket, _ahead, _queue
from sparkdeploy.steps.hold_nodes.records import (
    NodeHolder,
    Replaced,
    _read_holders,
    _write_holder,
    holder_variable,
    limit_name,
    machine_label,
)
from sparkdeploy.steps.hold_nodes.runs import _current_flow_run_id
from sparkdeploy.steps.hold_nodes.slots import _give_back_slots, _take_slots
from sparkdeploy.steps.hold_nodes.takeover import _take_over

DEFAULT_TIMEOUT_S = 600.0
POLL_S = 1.0
# How often each part of undoing a hold that could not be recorded is tried (each request also
# retried on busy answers by _api).
_UNDO_ATTEMPTS = 3

_LOG = logging.getLogger(__name__)


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
    taken over with a warning naming it (package docstring); without `containers_on` another
    deployment's holder is never proven gone. A holder whose deployment is in `replacing` is
    taken over once its flow run has ended, recording the Replaced it maps to. Returns the
    nodes newly taken (those taken over from another deployment or for a replacement
    included). Raises NodeLockError naming the holders when the wait runs out.
    """
    deadline = time.monotonic() + timeout_s
    waited_for: str | None = None
    with single_attempt_client() as client:
        acquisition = _Acquisition(
            client,
            cluster,
            machines,
            deployment_id,
            _current_flow_run_id(),
            containers_on,
            replacing or {},
            log,
            warn,
        )
        try:
            while isinstance(outcome := acquisition.attempt(), _Waiting):
                if time.monotonic() >= deadline:
                    raise NodeLockError(
                        f"deployment {deployment_id} could not take nodes"
                        f" {', '.join(outcome.nodes)} of cluster {cluster} within"
                        f" {timeout_s:.0f} s: {outcome.blockers}. Wait for that flow run, tear"
                        " that deployment down (the teardown flow) or choose other nodes"
                    )
                if outcome.blockers != waited_for:
                    log(f"waiting for nodes of cluster {cluster}: {outcome.blockers}")
                    waited_for = outcome.blockers
                time.sleep(poll_s)
            return outcome
        finally:
            acquisition.leave_queue()


@dataclass(frozen=True)
class _Waiting:
    """An attempt that must wait: the nodes it still wants, and who holds them or is ahead."""

    nodes: list[str]
    blockers: str


@dataclass
class _Acquisition:
    """One acquire_nodes call across its attempts: the nodes it has taken over so far and its
    wait ticket."""

    client: SyncPrefectClient
    cluster: str
    machines: Mapping[str, str]
    deployment_id: str
    flow_run_id: str | None
    containers_on: ContainerCheck | None
    replacing: Mapping[str, Replaced]
    log: Callable[[str], None]
    warn: Callable[[str], None]
    taken_over: list[str] = field(default_factory=list)
    ticket: str | None = None

    def attempt(self) -> list[str] | _Waiting:
        """Every node this run's (then the nodes newly taken), or what it must wait for (then
        its ticket is in the queue)."""
        while True:
            current = _read_holders(self.client, self.machines)
            decisions, why = _decide(
                self.client,
                current,
                self.deployment_id,
                self.flow_run_id,
                self.containers_on,
                self.replacing,
            )
            stale = {
                node: holder
                for node, holder in current.items()
                if holder is not None and decisions[node] == "take over"
            }
            if stale:
                if self._take_over(stale):
                    continue  # they are this run's now: decide again from the new records
                why.update(dict.fromkeys(stale, "another deploy is taking it over right now"))
            wanted = [node for node in self.machines if decisions.get(node) != "ours"]
            busy = [node for node in wanted if current[node] is not None]
            ahead = _ahead(self.client, self.ticket, self._of(wanted)) if wanted else []
            # Free, nobody ahead: take them, unless another deploy just did.
            if wanted and not busy and not ahead and not _take_slots(self.client, self._of(wanted)):
                busy = wanted
            if busy or ahead:
                self.ticket = _queue(
                    self.client, self.ticket, self.deployment_id, self.flow_run_id, self._of(wanted)
                )
                return _Waiting(wanted, self._blockers(wanted, busy, ahead, why))
            self._record(wanted)
            return [node for node in self.machines if node in wanted or node in self.taken_over]

    def leave_queue(self) -> None:
        if self.ticket is not None:
            with contextlib.suppress(ObjectNotFound):
                _api(self.client.delete_variable_by_name, self.ticket)

    def _take_over(self, stale: dict[str, NodeHolder]) -> bool:
        """The stale holders taken over; whether any was."""
        done = _take_over(
            self.client,
            self.cluster,
            stale,
            self.deployment_id,
            self.flow_run_id,
            self.replacing,
            log=self.log,
            warn=self.warn,
        )
        # Newly this run's, to give back on failure: those of other deployments, and those of
        # this one that a replacement would hand back.
        self.taken_over += [
            node
            for node in done
            if stale[node].deployment_id != self.deployment_id
            or stale[node].deployment_id in self.replacing
        ]
        return bool(done)

    def _blockers(
        self,
        wanted: Sequence[str],
        busy: Sequence[str],
        ahead: Sequence[WaitTicket],
        why: dict[str, str],
    ) -> str:
        held = [_describe_blockers(self.client, self.cluster, self._of(busy), why)] if busy else []
        return "; ".join(held + [found.describe(self._of(wanted)) for found in ahead])

    def _record(self, wanted: Sequence[str]) -> None:
        since = datetime.now(UTC).isoformat(timespec="seconds")
        _record_or_give_back(
            self.client,
            [
                NodeHolder(
                    node,
                    self.deployment_id,
                    since,
                    self.flow_run_id,
                    self.cluster,
                    self.machines[node],
                )
                for node in wanted
            ],
            warn=self.warn,
        )
        if wanted:
            held = ", ".join(
                f"{node} (machine {machine_label(self.machines[node])})" for node in wanted
            )
            self.log(f"deployment {self.deployment_id} holds {held} of cluster {self.cluster}")

    def _of(self, nodes: Sequence[str]) -> dict[str, str]:
        return {node: self.machines[node] for node in nodes}


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
