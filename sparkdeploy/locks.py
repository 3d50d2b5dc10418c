"""Node locks: one deployment per node, held from boot to teardown, across flow runs.

Each node has a Prefect global concurrency limit `node:<cluster>:<node>` with limit 1, created
on demand. A deployment takes one slot of every node's limit in a single request (all or none,
so two deploys on overlapping nodes cannot each hold half and wait forever) and gives them back
at teardown. The slots are taken without a lease: no process lives as long as a deployment, and
a lease would expire under a running engine. Who holds a node is recorded in a Prefect Variable
per node (`node-lock-...`, visible in the UI) so a waiting deploy can name the holder.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, ParamSpec, TypeVar
from uuid import UUID

import httpx
from prefect.client.base import PrefectHttpxSyncClient
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import (
    GlobalConcurrencyLimitCreate,
    VariableCreate,
    VariableUpdate,
)
from prefect.client.schemas.objects import Variable
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from sparkdeploy.errors import NodeLockError

DEFAULT_TIMEOUT_S = 600.0
POLL_S = 1.0
_HTTP_LOCKED = 423
_HTTP_BUSY = frozenset({429, 503})
_CHANGE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# How long a lock call retries Prefect's busy answers, and its first wait.
API_BUSY_RETRY_S = 30.0
API_BUSY_FIRST_WAIT_S = 0.05
# Prefect refuses to release slots held for 0 s.
_MIN_OCCUPANCY_S = 0.001

_LOG = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")


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


class _SingleAttemptHttpxClient(PrefectHttpxSyncClient):
    """Sends each request once; _api retries busy answers on its own, shorter schedule.

    On SQLite, Prefect answers 503 with Retry-After 2 when a write meets another writer, and
    Prefect's client sleeps those 2 s even when its retries are turned off; the node locks of
    a deploy paid it once or twice per run.
    """

    def _send_with_retry(
        self,
        request: httpx.Request,
        send: Callable[..., httpx.Response],
        send_args: tuple[Any, ...],
        send_kwargs: dict[str, Any],
        retry_codes: AbstractSet[int] = frozenset(),
        retry_exceptions: tuple[type[Exception], ...] = (),
    ) -> httpx.Response:
        if self.enable_csrf_support and request.method.upper() in _CHANGE_METHODS:
            self._add_csrf_headers(request=request)
        return send(request, *send_args, **send_kwargs)


@contextlib.contextmanager
def _lock_client() -> Iterator[SyncPrefectClient]:
    """A Prefect client of the lock calls' own: one attempt per request (see _api).

    Given httpx_settings, get_client makes a new client instead of handing back the run's
    shared one, whose requests keep Prefect's own retries (a run's client made single-attempt
    here failed a later artifact on one dropped connection).
    """
    with get_client(httpx_settings={}, sync_client=True) as client:
        if type(client._client) is PrefectHttpxSyncClient:
            client._client.__class__ = _SingleAttemptHttpxClient
        yield client


def _api(call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`call(*args, **kwargs)`, retried on Prefect's busy answers (429, 503) and on transport
    errors after short, growing waits."""
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


def _take_slots(client: SyncPrefectClient, cluster: str, nodes: Sequence[str]) -> bool:
    """One slot of every node's limit, all or none, creating the limits that do not exist yet;
    False when one of them is full."""
    names = [limit_name(cluster, node) for node in nodes]
    for _ in range(2):
        try:
            response = _api(
                client.increment_concurrency_slots, names=names, slots=1, mode="concurrency"
            )
        except httpx.HTTPStatusError as error:
            if error.response.status_code != _HTTP_LOCKED:
                raise
            return False
        # The server skips names without a limit and takes the slots of the others.
        taken = {str(limit["name"]) for limit in response.json()}
        missing = [name for name in names if name not in taken]
        if not missing:
            return True
        if taken:
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
    raise NodeLockError(f"the node limits {', '.join(names)} vanish as soon as they are created")


def _read_holders(
    client: SyncPrefectClient, cluster: str, nodes: Sequence[str]
) -> dict[str, NodeHolder | None]:
    """Every node's holder record, in one request."""
    by_variable = {holder_variable(cluster, node): node for node in nodes}
    query = {"variables": {"name": {"any_": list(by_variable)}}, "limit": len(by_variable)}
    response = _api(client.request, "POST", "/variables/filter", json=query)
    found: dict[str, NodeHolder | None] = dict.fromkeys(nodes)
    for variable in Variable.model_validate_list(response.json()):
        node = by_variable.get(variable.name)
        if node is None or not isinstance(variable.value, dict):
            continue
        value: dict[str, Any] = variable.value
        found[node] = NodeHolder(
            node=node,
            deployment_id=str(value.get("deployment_id")),
            since=str(value.get("since")),
            flow_run_id=value.get("flow_run_id"),
        )
    return found


def _write_holder(client: SyncPrefectClient, cluster: str, holder: NodeHolder) -> None:
    name = holder_variable(cluster, holder.node)
    value = {
        "deployment_id": holder.deployment_id,
        "since": holder.since,
        "flow_run_id": holder.flow_run_id,
    }
    tags = ["sparkdeploy", "node-lock"]
    try:
        _api(client.create_variable, VariableCreate(name=name, value=value, tags=tags))
    except ObjectAlreadyExists:
        _api(client.update_variable, VariableUpdate(name=name, value=value, tags=tags))


def holders(cluster: str, nodes: Sequence[str]) -> dict[str, NodeHolder | None]:
    """Who holds each node (None: free, or taken by a deploy that has not recorded itself)."""
    with _lock_client() as client:
        return _read_holders(client, cluster, nodes)


def _describe_blockers(client: SyncPrefectClient, cluster: str, nodes: Sequence[str]) -> str:
    described = []
    current = _read_holders(client, cluster, nodes)
    for node in nodes:
        try:
            limit = _api(client.read_global_concurrency_limit_by_name, limit_name(cluster, node))
        except ObjectNotFound:
            continue  # never taken: the attempt that failed took no slot anywhere
        if limit.active_slots < limit.limit:
            continue
        holder = current[node]
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
        run = _api(client.read_flow_run, UUID(flow_run_id))
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
    with _lock_client() as client:
        while True:
            current = _read_holders(client, cluster, nodes)
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
            if wanted and not blocked and not _take_slots(client, cluster, wanted):
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
    with _lock_client() as client:
        held_since: dict[str, list[str]] = {}
        for node, holder in _read_holders(client, cluster, nodes).items():
            if holder is None or holder.deployment_id != deployment_id:
                continue
            _api(client.delete_variable_by_name, holder_variable(cluster, node))
            held_since.setdefault(holder.since, []).append(node)
            released.append(node)
        for since, held in held_since.items():
            names = [limit_name(cluster, node) for node in held]
            _api(
                client.release_concurrency_slots,
                names=names,
                slots=1,
                occupancy_seconds=_held_seconds(since),
            )
    if released:
        log(f"deployment {deployment_id} released {', '.join(released)} of cluster {cluster}")
    return released


def _held_seconds(since_iso: str) -> float:
    try:
        since = datetime.fromisoformat(since_iso)
    except ValueError:
        return _MIN_OCCUPANCY_S
    return max(_MIN_OCCUPANCY_S, (datetime.now(UTC) - since).total_seconds())
