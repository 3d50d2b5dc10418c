"""A deployment's hold undone or settled: given back to what it replaced, handed back to the run
whose copy still serves, committed once its replacement succeeded, or released."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

from prefect.client.orchestration import SyncPrefectClient

from sparkdeploy.remote.prefect_api import single_attempt_client
from sparkdeploy.steps.hold_nodes.api import _api
from sparkdeploy.steps.hold_nodes.records import (
    NodeHolder,
    Replaced,
    _recorded_holders,
    _write_holder,
    holder_variable,
)
from sparkdeploy.steps.hold_nodes.runs import _current_flow_run_id
from sparkdeploy.steps.hold_nodes.slots import _give_back_slots

_LOG = logging.getLogger(__name__)


def _records_of(
    client: SyncPrefectClient, cluster: str, nodes: Collection[str], deployment_id: str
) -> list[NodeHolder]:
    """The holder records of `deployment_id` on those of `nodes` (as `cluster` names them) it
    holds."""
    wanted = set(nodes)
    return [
        holder
        for holder in _recorded_holders(client)
        if holder.cluster == cluster
        and holder.node in wanted
        and holder.deployment_id == deployment_id
    ]


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
    with single_attempt_client() as client:
        for holder in _records_of(client, cluster, nodes, deployment_id):
            if holder.flow_run_id != run_id:
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
    back = []
    with single_attempt_client() as client:
        for holder in _records_of(client, cluster, serving, deployment_id):
            if (
                holder.flow_run_id != run_id
                or holder.took_over_from is None
                or holder.replaces is not None
            ):
                continue
            _write_holder(
                client, replace(holder, flow_run_id=holder.took_over_from, took_over_from=None)
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
    with single_attempt_client() as client:
        for holder in _records_of(client, cluster, nodes, deployment_id):
            if holder.replaces is not None:
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
    with single_attempt_client() as client:
        held_since: dict[str, list[str]] = {}
        for holder in _records_of(client, cluster, nodes, deployment_id):
            _api(client.delete_variable_by_name, holder_variable(holder.machine_id))
            held_since.setdefault(holder.since, []).append(holder.machine_id)
            released.append(holder.node)
        for since, held in held_since.items():
            _give_back_slots(client, held, since)
    released = [node for node in nodes if node in released]
    if released:
        log(f"deployment {deployment_id} released {', '.join(released)} of cluster {cluster}")
    return released
