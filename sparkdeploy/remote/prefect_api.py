"""Prefect's client where its public API falls short: the one place that touches its internals.

tests/test_prefect_api.py fails when an upgrade changes what this module relies on (checked
against Prefect 3.9.1). Upstream sources, in PrefectHQ/prefect:

Requests sent once (`single_attempt_client`). src/prefect/client/base.py:
`PrefectHttpxSyncClient.send` hands every request to `_send_with_retry`, which on 429, 502, 503
or 408 sleeps before it looks at its retry budget: the `Retry-After` header's seconds when the
answer has one, else `2 ** attempt` (2 s after the first attempt), with jitter. So even with
PREFECT_CLIENT_MAX_RETRIES=0 a busy answer costs about 2 s before the caller sees it. The
busy answer the node locks meet is SQLite's: a write that meets another writer fails with
"database is locked" and the server answers 503 (src/prefect/server/api/server.py,
`is_client_retryable_exception`; 3.9.1 sends no `Retry-After` with it, so the wait is the 2 s
backoff). The node locks of a deploy paid it once or twice per run; their caller
(sparkdeploy.steps.hold_nodes) retries busy answers on its own, shorter schedule instead. On
PostgreSQL, writes wait for each other's row locks and never meet "database is locked", so
sending once costs nothing there (its rarer 503, a dropped database connection, is retried by
the caller all the same). The private pieces:
  - `_send_with_retry(request, send, send_args, send_kwargs, retry_codes, retry_exceptions)`,
    overridden to send once;
  - `_add_csrf_headers(request)` and the `enable_csrf_support` attribute, which the override
    must keep calling for a change request, as the original does before its first attempt
    (what sending once gives up: the original's resend after a 403 "Invalid CSRF token", which
    only a server with CSRF protection on, off by default, answers);
  - `SyncPrefectClient._client`, the PrefectHttpxSyncClient it sends through
    (src/prefect/client/orchestration/__init__.py, `SyncPrefectClient.__init__`), whose class is
    swapped for the single-attempt one: Prefect builds that client itself, from settings (API
    URL, auth, TLS, headers) this module should not rebuild.
`get_client(httpx_settings={}, sync_client=True)` makes a client of our own, not the flow run's
shared one (get_client hands that back only for the same httpx_settings, None by default), so
the run's other requests keep Prefect's retries.

Variables by name or by tags (`filter_variables`). In 3.9.1 SyncPrefectClient has no public
variables filter: `read_variables(limit)` takes nothing but a limit and `read_variable_by_name`
one name (src/prefect/client/orchestration/_variables/client.py). The server's route does
filter (src/prefect/server/api/variables.py, `read_variables`: POST /variables/filter with
`variables`, a VariableFilter, and `limit`, `offset`, `sort`), so this module posts to it
through the client's `request`, the body built from Prefect's own public VariableFilter
schema.

Flow runs that end without waiting for their heartbeat thread
(`end_runs_without_waiting_for_heartbeats`). src/prefect/flow_engine.py: `_send_heartbeats(engine,
join_on_exit=True)` runs a daemon thread for every flow run that sends a heartbeat every
PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (180 by default: heartbeats are on) and sleeps
between them in steps of 1 s; at the run's end it sets a stop event and, with join_on_exit,
joins the thread, which wakes only at the end of its current 1 s step. So every synchronous
flow run ended about 1 s after its last task (an empty flow: 1.15 s with it, 0.13 s without).
The async engine passes join_on_exit=False for its own reason (not to block the event loop); the
thread, stopped, exits at its next step without sending anything, so sync runs are given the
same: `prefect.flow_engine._send_heartbeats` is wrapped to pass join_on_exit=False. Installed by
the `tasks` package, which every flow imports.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, ParamSpec, TypeVar

import httpx
from prefect.client.base import PrefectHttpxSyncClient
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.filters import VariableFilter, VariableFilterName, VariableFilterTags
from prefect.client.schemas.objects import Variable
from prefect.client.schemas.sorting import VariableSort

_CHANGE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_INSTALLED = "_sparkdeploy_unjoined"
_HTTP_BUSY = frozenset({429, 503})
# The first wait before a busy answer is retried, doubled each time up to the last.
BUSY_FIRST_WAIT_S = 0.05
BUSY_LAST_WAIT_S = 1.0

T = TypeVar("T")
P = ParamSpec("P")


class SingleAttemptHttpxClient(PrefectHttpxSyncClient):
    """Prefect's HTTP client, sending each request once: a busy answer (429, 503) is raised at
    once, without the wait Prefect's client takes even when its retries are off."""

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
def single_attempt_client() -> Iterator[SyncPrefectClient]:
    """A Prefect client of our own whose requests are sent once each (the caller retries what it
    means to). Inside a flow run, the run's shared client is left as it is: a run's client made
    single-attempt here once failed a later artifact on one dropped connection.

    One is kept open per process and API settings (URL, key, TLS), shared by every thread
    (httpx's client is thread-safe), and closed at exit: making one cost a deploy about 20 ms of
    CPU each time (Prefect builds an SSL context for every client, parsing the CA file even for
    an http:// server) and its first write a request for a CSRF token."""
    from prefect.settings import get_current_settings

    key = get_current_settings().api.model_dump_json()
    with _KEPT_LOCK:
        client = _KEPT.get(key)
        if client is None:
            client = get_client(httpx_settings={}, sync_client=True)
            client.__enter__()
            if type(client._client) is PrefectHttpxSyncClient:
                client._client.__class__ = SingleAttemptHttpxClient
            _KEPT[key] = client
    yield client


_KEPT: dict[str, SyncPrefectClient] = {}
_KEPT_LOCK = threading.Lock()


@atexit.register
def _close_kept_clients() -> None:
    with _KEPT_LOCK:
        for client in _KEPT.values():
            with contextlib.suppress(Exception):
                client.__exit__(None, None, None)
        _KEPT.clear()


def retried_when_busy(
    within_s: float, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs
) -> T:
    """`call(*args, **kwargs)` (a request of a single_attempt_client), retried on Prefect's busy
    answers (429, 503: SQLite's "database is locked") and on transport errors, after short,
    growing, jittered waits, for up to `within_s` seconds; then the last error is raised."""
    deadline = time.monotonic() + within_s
    delay = BUSY_FIRST_WAIT_S
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
        delay = min(delay * 2, BUSY_LAST_WAIT_S)


def filter_variables(
    client: SyncPrefectClient,
    *,
    names: Sequence[str] | None = None,
    tags: Sequence[str] | None = None,
    limit: int,
    offset: int = 0,
) -> list[Variable]:
    """The variables named any of `names` and tagged with all of `tags` (each only when given),
    in name order, `limit` of them from `offset`. One request."""
    criteria: dict[str, Any] = {}
    if names is not None:
        criteria["name"] = VariableFilterName(any_=list(names))
    if tags is not None:
        criteria["tags"] = VariableFilterTags(all_=list(tags))
    body = {
        "variables": VariableFilter(**criteria).model_dump(mode="json"),
        "limit": limit,
        "offset": offset,
        "sort": VariableSort.NAME_ASC.value,  # the server's default, named: pages need an order
    }
    response = client.request("POST", "/variables/filter", json=body)
    return Variable.model_validate_list(response.json())


def end_runs_without_waiting_for_heartbeats() -> None:
    """Flow runs end without joining their heartbeat thread (module docstring). Idempotent."""
    from prefect import flow_engine

    send_heartbeats = flow_engine._send_heartbeats
    if getattr(send_heartbeats, _INSTALLED, False):
        return

    @functools.wraps(send_heartbeats)
    def unjoined(engine: Any, join_on_exit: bool = True) -> contextlib.AbstractContextManager[None]:
        return send_heartbeats(engine, join_on_exit=False)

    setattr(unjoined, _INSTALLED, True)
    flow_engine._send_heartbeats = unjoined  # type: ignore[assignment]
