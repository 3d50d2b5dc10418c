"""Node locks: one deployment per node, held from boot to teardown, across flow runs.

Each node has a Prefect global concurrency limit `node:<cluster>:<node>` with limit 1, created
on demand. A deployment takes one slot of every node's limit in a single request (all or none,
so two deploys on overlapping nodes cannot each hold half and wait forever) and gives them back
at teardown. The slots are taken without a lease: no process lives as long as a deployment, and
a lease would expire under a running engine. Who holds a node is recorded in a Prefect Variable
per node (`node-lock-...`, visible in the UI) so a waiting deploy can name the holder.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import httpx
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import (
    GlobalConcurrencyLimitCreate,
    VariableCreate,
    VariableUpdate,
)
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from sparkdeploy.errors import NodeLockError

DEFAULT_TIMEOUT_S = 600.0
POLL_S = 1.0
_HTTP_LOCKED = 423

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeHolder:
    node: str
    deployment_id: str
    since: str  # ISO 8601, UTC
    flow_run_id: str | None


def limit_name(cluster: str, node: str) -> str:
    return f"node:{cluster}:{node}"


def holder_variable(cluster: str, node: str) -> str:
    """Variable names allow lowercase letters, digits, '-' and '_' only: a readable slug plus a
    digest of the exact names, so clusters or nodes differing only in case stay apart."""
    slug = re.sub(r"[^a-z0-9]+", "-", f"{cluster}-{node}".lower()).strip("-")
    digest = hashlib.sha256(limit_name(cluster, node).encode()).hexdigest()[:8]
    return f"node-lock-{slug}-{digest}"


def _current_flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    run_id = flow_run.id
    return str(run_id) if run_id else None


def _ensure_limit(client: SyncPrefectClient, name: str) -> None:
    try:
        client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        except ObjectAlreadyExists:
            return  # another deploy created it a moment ago


def _read_holder(client: SyncPrefectClient, cluster: str, node: str) -> NodeHolder | None:
    variable = client.read_variable_by_name(holder_variable(cluster, node))
    if variable is None or not isinstance(variable.value, dict):
        return None
    value: dict[str, Any] = variable.value
    return NodeHolder(
        node=node,
        deployment_id=str(value.get("deployment_id")),
        since=str(value.get("since")),
        flow_run_id=value.get("flow_run_id"),
    )


def _write_holder(client: SyncPrefectClient, cluster: str, holder: NodeHolder) -> None:
    name = holder_variable(cluster, holder.node)
    value = {
        "deployment_id": holder.deployment_id,
        "since": holder.since,
        "flow_run_id": holder.flow_run_id,
    }
    tags = ["sparkdeploy", "node-lock"]
    if client.read_variable_by_name(name) is None:
        try:
            client.create_variable(VariableCreate(name=name, value=value, tags=tags))
            return
        except ObjectAlreadyExists:
            pass
    client.update_variable(VariableUpdate(name=name, value=value, tags=tags))


def holders(cluster: str, nodes: Sequence[str]) -> dict[str, NodeHolder | None]:
    """Who holds each node (None: free, or taken by a deploy that has not recorded itself)."""
    with get_client(sync_client=True) as client:
        return {node: _read_holder(client, cluster, node) for node in nodes}


def _describe_blockers(client: SyncPrefectClient, cluster: str, nodes: Sequence[str]) -> str:
    described = []
    for node in nodes:
        limit = client.read_global_concurrency_limit_by_name(limit_name(cluster, node))
        if limit.active_slots < limit.limit:
            continue
        holder = _read_holder(client, cluster, node)
        if holder is None:
            described.append(
                f"{node} is held by an unrecorded holder (a deploy taking it right now, or one"
                " that crashed while taking it: if no deployment runs there, reset the limit"
                f" `{limit_name(cluster, node)}` to 0 active slots in the Prefect UI)"
            )
        else:
            run = f", flow run {holder.flow_run_id}" if holder.flow_run_id else ""
            described.append(
                f"{node} is held by deployment {holder.deployment_id} since {holder.since}{run}"
            )
    return "; ".join(described) or "the nodes were released while this deploy was giving up"


def _run_is_live(client: SyncPrefectClient, flow_run_id: str | None) -> bool:
    """Whether the flow run that recorded itself as a holder is still running."""
    if flow_run_id is None:
        return False
    try:
        run = client.read_flow_run(UUID(flow_run_id))
    except ObjectNotFound:
        return False
    return run.state is not None and not run.state.is_final()


def _ours_to_keep(
    client: SyncPrefectClient,
    holder: NodeHolder | None,
    deployment_id: str,
    flow_run_id: str | None,
) -> bool:
    """A node this deployment holds and may go on holding from this flow run: taken by this run,
    or by an earlier run of the same deployment that has ended (a redeploy). Another run of the
    same deployment that is still going (a concurrent deploy) must be waited for."""
    if holder is None or holder.deployment_id != deployment_id:
        return False
    return holder.flow_run_id == flow_run_id or not _run_is_live(client, holder.flow_run_id)


def acquire_nodes(
    cluster: str,
    nodes: Sequence[str],
    deployment_id: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    poll_s: float = POLL_S,
    log: Callable[[str], None] = _LOG.info,
) -> list[str]:
    """Hold every node for `deployment_id`, waiting up to timeout_s for another to let go.

    Idempotent for one deployment: nodes it already holds are kept (and recorded as held by
    this flow run), unless another flow run of it is still going. Returns the nodes newly
    taken. Raises NodeLockError naming the holders when the wait runs out.
    """
    deadline = time.monotonic() + timeout_s
    waited_for: str | None = None
    flow_run_id = _current_flow_run_id()
    with get_client(sync_client=True) as client:
        for node in nodes:
            _ensure_limit(client, limit_name(cluster, node))
        while True:
            current = {node: _read_holder(client, cluster, node) for node in nodes}
            kept = [
                node
                for node, holder in current.items()
                if _ours_to_keep(client, holder, deployment_id, flow_run_id)
            ]
            wanted = [node for node in nodes if node not in kept]
            blocked = [
                node
                for node in wanted
                if (holder := current[node]) is not None and holder.deployment_id == deployment_id
            ]
            if wanted and not blocked:
                try:
                    client.increment_concurrency_slots(
                        names=[limit_name(cluster, node) for node in wanted],
                        slots=1,
                        mode="concurrency",
                    )
                except httpx.HTTPStatusError as error:
                    if error.response.status_code != _HTTP_LOCKED:
                        raise
                    blocked = wanted
            if blocked:
                blockers = _describe_blockers(client, cluster, blocked)
                if time.monotonic() >= deadline:
                    raise NodeLockError(
                        f"deployment {deployment_id} could not take nodes {', '.join(wanted)} of"
                        f" cluster {cluster} within {timeout_s:.0f} s: {blockers}. Wait for that"
                        " flow run, tear that deployment down (the teardown flow) or choose"
                        " other nodes"
                    )
                if blockers != waited_for:
                    log(f"waiting for nodes of cluster {cluster}: {blockers}")
                    waited_for = blockers
                time.sleep(poll_s)
                continue
            since = datetime.now(UTC).isoformat(timespec="seconds")
            for node in nodes:
                holder = current[node]
                if node in wanted or (holder is not None and holder.flow_run_id != flow_run_id):
                    _write_holder(
                        client,
                        cluster,
                        NodeHolder(
                            node,
                            deployment_id,
                            since if node in wanted or holder is None else holder.since,
                            flow_run_id,
                        ),
                    )
            if wanted:
                log(f"deployment {deployment_id} holds {', '.join(wanted)} of cluster {cluster}")
            return wanted


def release_nodes(
    cluster: str,
    nodes: Sequence[str],
    deployment_id: str,
    *,
    log: Callable[[str], None] = _LOG.info,
) -> list[str]:
    """Give back the nodes `deployment_id` holds; others' nodes stay as they are. Idempotent.

    The holder record goes first: a crash in between leaves a node locked by an unrecorded
    holder (safe, and named as such) rather than free with a stale record.
    """
    released = []
    with get_client(sync_client=True) as client:
        for node in nodes:
            holder = _read_holder(client, cluster, node)
            if holder is None or holder.deployment_id != deployment_id:
                continue
            client.delete_variable_by_name(holder_variable(cluster, node))
            client.release_concurrency_slots(
                names=[limit_name(cluster, node)],
                slots=1,
                occupancy_seconds=_held_seconds(holder),
            )
            released.append(node)
    if released:
        log(f"deployment {deployment_id} released {', '.join(released)} of cluster {cluster}")
    return released


def _held_seconds(holder: NodeHolder) -> float:
    try:
        since = datetime.fromisoformat(holder.since)
    except ValueError:
        return 0.0
    return max(0.0, (datetime.now(UTC) - since).total_seconds())
