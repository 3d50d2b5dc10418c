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

    Idempotent: nodes this deployment already holds are kept. Returns the nodes newly taken.
    Raises NodeLockError naming the holding deployment(s) when the wait runs out.
    """
    deadline = time.monotonic() + timeout_s
    waited_for: str | None = None
    with get_client(sync_client=True) as client:
        for node in nodes:
            _ensure_limit(client, limit_name(cluster, node))
        while True:
            wanted = [
                node
                for node in nodes
                if (held := _read_holder(client, cluster, node)) is None
                or held.deployment_id != deployment_id
            ]
            if not wanted:
                return []
            try:
                client.increment_concurrency_slots(
                    names=[limit_name(cluster, node) for node in wanted],
                    slots=1,
                    mode="concurrency",
                )
            except httpx.HTTPStatusError as error:
                if error.response.status_code != _HTTP_LOCKED:
                    raise
                blockers = _describe_blockers(client, cluster, wanted)
                if time.monotonic() >= deadline:
                    raise NodeLockError(
                        f"deployment {deployment_id} could not take nodes {', '.join(wanted)} of"
                        f" cluster {cluster} within {timeout_s:.0f} s: {blockers}. Tear that"
                        " deployment down (the teardown flow) or choose other nodes"
                    ) from error
                if blockers != waited_for:
                    log(f"waiting for nodes of cluster {cluster}: {blockers}")
                    waited_for = blockers
                time.sleep(poll_s)
                continue
            since = datetime.now(UTC).isoformat(timespec="seconds")
            flow_run_id = _current_flow_run_id()
            for node in wanted:
                _write_holder(client, cluster, NodeHolder(node, deployment_id, since, flow_run_id))
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
