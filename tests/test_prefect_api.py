"""The adapter over Prefect's private client pieces (sparkdeploy.remote.prefect_api): the names
it relies on still exist with the same shape, its client sends a busy answer back at once, and
its variables filter finds variables on a real Prefect server. An upgrade that changes any of
them fails here, not in a deploy's node locks."""

from __future__ import annotations

import inspect
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import httpx
import pytest
from prefect import flow
from prefect.client.base import PrefectHttpxSyncClient
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import VariableCreate
from prefect.client.schemas.objects import Variable
from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

from sparkdeploy.remote.prefect_api import (
    SingleAttemptHttpxClient,
    end_runs_without_waiting_for_heartbeats,
    filter_variables,
    single_attempt_client,
)


def test_the_private_names_have_the_shape_the_adapter_relies_on() -> None:
    # PrefectHttpxSyncClient.send calls _send_with_retry by these keywords.
    parameters = list(inspect.signature(PrefectHttpxSyncClient._send_with_retry).parameters)
    assert parameters == [
        "self",
        "request",
        "send",
        "send_args",
        "send_kwargs",
        "retry_codes",
        "retry_exceptions",
    ]
    assert list(inspect.signature(SingleAttemptHttpxClient._send_with_retry).parameters) == (
        parameters
    )
    assert list(inspect.signature(PrefectHttpxSyncClient._add_csrf_headers).parameters) == [
        "self",
        "request",
    ]
    for enabled in (True, False):
        with PrefectHttpxSyncClient(enable_csrf_support=enabled) as http:
            assert http.enable_csrf_support is enabled


def test_there_is_still_no_public_variables_filter() -> None:
    """When this fails, SyncPrefectClient may filter variables itself: filter_variables could
    call it instead of posting to the route."""
    assert list(inspect.signature(SyncPrefectClient.read_variables).parameters) == [
        "self",
        "limit",
    ]


def test_the_client_prefect_builds_is_the_one_swapped(prefect_harness: Path) -> None:
    with get_client(httpx_settings={}, sync_client=True) as client:
        assert type(client._client) is PrefectHttpxSyncClient
    with single_attempt_client() as client:
        assert type(client._client) is SingleAttemptHttpxClient
        assert client.read_variable_by_name(f"absent-{uuid.uuid4().hex}") is None


def test_a_flow_runs_own_client_keeps_prefects_retries(prefect_harness: Path) -> None:
    @flow
    def using_both() -> tuple[type, type, bool]:
        with get_client(sync_client=True) as run_client, single_attempt_client() as own:
            return type(run_client._client), type(own._client), own is run_client

    run_http, own_http, shared = using_both()
    assert (run_http, own_http, shared) == (PrefectHttpxSyncClient, SingleAttemptHttpxClient, False)


class _Busy(BaseHTTPRequestHandler):
    """Answers every request 503, as Prefect's server answers a write that met SQLite's lock."""

    retry_after: ClassVar[str | None] = None
    paths: ClassVar[list[str]] = []  # each server's handler class has its own (busy_api)

    def do_GET(self) -> None:
        self.paths.append(self.path)
        body = b'{"exception_message": "Service Unavailable"}'
        self.send_response(503)
        if self.retry_after is not None:
            self.send_header("Retry-After", self.retry_after)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(params=[None, "2"], ids=["no-retry-after", "retry-after-2"])
def busy_api(request: pytest.FixtureRequest, prefect_harness: Path) -> Iterator[list[str]]:
    """PREFECT_API_URL set to a server on 127.0.0.1 that answers everything 503 (with the
    parameter as its Retry-After); the paths it was asked for."""
    paths: list[str] = []
    handler = type("Busy", (_Busy,), {"retry_after": request.param, "paths": paths})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    serving = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    serving.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/api"
        with temporary_settings({PREFECT_API_URL: url}):
            yield paths
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every sleep this test's thread asks for, recorded instead of slept."""
    asked: list[float] = []
    this_thread = threading.get_ident()
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if threading.get_ident() == this_thread:
            asked.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    return asked


def test_a_busy_answer_comes_back_at_once_from_the_single_attempt_client(
    busy_api: list[str], waits: list[float]
) -> None:
    with single_attempt_client() as client, pytest.raises(httpx.HTTPStatusError) as caught:
        client.read_variable_by_name("node-lock-0123456789ab")
    assert caught.value.response.status_code == 503
    assert busy_api == ["/api/variables/name/node-lock-0123456789ab"]
    assert waits == []


def test_prefects_own_client_still_waits_on_a_busy_answer_with_its_retries_off(
    busy_api: list[str], waits: list[float]
) -> None:
    """Why the single-attempt client exists. When this fails, Prefect's client no longer waits
    before giving a busy answer back, and single_attempt_client may go."""
    with (
        temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}),
        get_client(httpx_settings={}, sync_client=True) as client,
        pytest.raises(httpx.HTTPStatusError),
    ):
        client.read_variable_by_name("node-lock-0123456789ab")
    assert len(busy_api) == 1
    assert len(waits) == 1
    assert waits[0] >= 1.5


def named(variables: list[Variable]) -> list[str]:
    return [variable.name for variable in variables]


def test_variables_are_found_by_name_and_by_tags(prefect_harness: Path) -> None:
    prefix = f"adapter-{uuid.uuid4().hex[:8]}"
    tag = prefix  # this test's own: the session's server holds other tests' variables
    tagged = {"a": [tag, "x"], "b": [tag, "x"], "c": [tag], "d": []}
    names = {key: f"{prefix}-{key}" for key in tagged}
    # Set up and cleaned up with Prefect's own retries: on SQLite a write may meet another.
    with get_client(sync_client=True) as setup:
        for key, tags in tagged.items():
            setup.create_variable(VariableCreate(name=names[key], value={"key": key}, tags=tags))
    with single_attempt_client() as client, get_client(sync_client=True) as setup:
        try:
            by_name = filter_variables(
                client, names=[names["c"], names["a"], f"{prefix}-absent"], limit=10
            )
            assert named(by_name) == [names["a"], names["c"]]
            assert named(filter_variables(client, tags=[tag, "x"], limit=10)) == [
                names["a"],
                names["b"],
            ]
            both = filter_variables(
                client, names=[names["a"], names["c"]], tags=[tag, "x"], limit=10
            )
            assert named(both) == [names["a"]]
            first = filter_variables(client, tags=[tag], limit=2)
            second = filter_variables(client, tags=[tag], limit=2, offset=2)
            assert (named(first), named(second)) == ([names["a"], names["b"]], [names["c"]])
            (variable,) = filter_variables(client, names=[names["d"]], limit=1)
            assert (variable.value, variable.tags) == ({"key": "d"}, [])
        finally:
            for name in names.values():
                setup.delete_variable_by_name(name)


def test_prefects_heartbeat_context_takes_what_the_adapter_passes() -> None:
    from prefect import flow_engine

    end_runs_without_waiting_for_heartbeats()
    original = flow_engine._send_heartbeats.__wrapped__  # type: ignore[attr-defined]
    assert list(inspect.signature(original).parameters) == ["engine", "join_on_exit"]


def test_a_flow_run_ends_without_waiting_for_its_heartbeat_thread(prefect_harness: Path) -> None:
    end_runs_without_waiting_for_heartbeats()

    @flow
    def empty() -> None:
        pass

    empty()  # Prefect's own service threads start with the first run
    before = set(threading.enumerate())
    empty()
    # The heartbeat thread runs contextvars.Context.run (src/prefect/flow_engine.py).
    left = [t for t in threading.enumerate() if t not in before and t.name.endswith("(run)")]
    assert left, "the run waited for its heartbeat thread to end"
    for thread in left:
        thread.join(timeout=3)
        assert not thread.is_alive(), "the stopped heartbeat thread did not end"
