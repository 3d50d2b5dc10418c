"""Plain HTTP to an engine's API (sparkdeploy.remote.engine_http) against a real HTTP server on
127.0.0.1, started by each test: status codes and bodies as sent, the API key as a bearer header,
no proxy, server-sent events as they arrive, and the timeouts of a read and of a whole stream."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from sparkdeploy.remote.engine_http import HttpReply, request, scrape_metrics, stream_events
from sparkdeploy.vllm.metrics import parse_metrics

METRICS_PAGE = (Path(__file__).parent / "fixtures" / "vllm-0.32-cpu" / "metrics.txt").read_text()
WAIT_CAP_S = 5.0  # the longest a stalled reply holds its thread, should the test not release it


@dataclass(frozen=True)
class Seen:
    """A request as the server received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # as uvicorn speaks: keep-alive, chunked streams
    server: EngineStub

    def do_GET(self) -> None:
        self.server.serve(self)

    do_POST = do_PUT = do_DELETE = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


Route = Callable[[Handler], None]


class EngineStub(ThreadingHTTPServer):
    """An HTTP server on a free loopback port; each path a route, every request recorded."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.routes: dict[str, Route] = {}
        self.seen: list[Seen] = []
        self.release = threading.Event()  # ends every stalled reply

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def url(self, path: str) -> str:
        return self.base + path

    def serve(self, handler: Handler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        # The request line as sent: http.server itself collapses a leading "//" in handler.path.
        raw_path = handler.requestline.split()[1]
        self.seen.append(Seen(handler.command, raw_path, dict(handler.headers), body))
        route = self.routes.get(handler.path.split("?")[0], echo)
        route(handler)

    def stall(self) -> None:
        self.release.wait(WAIT_CAP_S)

    def late(self, handler: Handler) -> None:
        """A route that answers only once the test is over."""
        self.stall()
        handler.reply(200, b"late")

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out and left: the reply's write fails, as it should


def echo(handler: Handler) -> None:
    seen = handler.server.seen[-1]
    handler.reply(
        200,
        json.dumps(
            {
                "method": seen.method,
                "path": seen.path,
                "authorization": seen.headers.get("Authorization"),
                "content_type": seen.headers.get("Content-Type"),
                "body": seen.body.decode(),
            }
        ).encode(),
    )


def sse(*events: dict[str, Any]) -> list[bytes]:
    return [b"data: " + json.dumps(event).encode() + b"\n\n" for event in events]


@pytest.fixture
def engine() -> Iterator[EngineStub]:
    server = EngineStub()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def refusing_url() -> Iterator[str]:
    """A loopback port bound but not listening: a connection to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_get_returns_the_status_and_the_body(engine: EngineStub) -> None:
    engine.routes["/v1/models"] = lambda h: h.reply(200, b'{"data": [{"id": "tiny-chat"}]}')
    reply = request("GET", engine.url("/v1/models"), timeout=5)
    assert reply == HttpReply(200, b'{"data": [{"id": "tiny-chat"}]}')
    assert reply.json() == {"data": [{"id": "tiny-chat"}]}
    assert [(seen.method, seen.path, seen.body) for seen in engine.seen] == [
        ("GET", "/v1/models", b"")
    ]


@pytest.mark.parametrize("status", [201, 204, 401, 404, 500, 503])
def test_any_status_is_returned_not_raised(engine: EngineStub, status: int) -> None:
    body = b"" if status == 204 else f"status {status}".encode()
    engine.routes["/x"] = lambda h: h.reply(status, body, "text/plain")
    assert request("GET", engine.url("/x"), timeout=5) == HttpReply(status, body)


def test_a_json_body_is_sent_as_json_with_its_content_type(engine: EngineStub) -> None:
    payload = {"model": "tiny-chat", "messages": [{"role": "user", "content": "héllo | ✓"}]}
    reply = request("POST", engine.url("/v1/chat/completions"), timeout=5, json_body=payload)
    echoed = reply.json()
    assert echoed["method"] == "POST"
    assert echoed["content_type"] == "application/json"
    assert json.loads(echoed["body"]) == payload


def test_an_empty_json_body_is_still_sent(engine: EngineStub) -> None:
    echoed = request("POST", engine.url("/reset"), timeout=5, json_body={}).json()
    assert (echoed["body"], echoed["content_type"]) == ("{}", "application/json")


def test_a_request_without_a_body_sends_no_content_type(engine: EngineStub) -> None:
    echoed = request("DELETE", engine.url("/thing"), timeout=5).json()
    assert (echoed["method"], echoed["body"], echoed["content_type"]) == ("DELETE", "", None)


def test_the_api_key_is_sent_as_a_bearer_header_and_only_when_given(engine: EngineStub) -> None:
    keyed = request("GET", engine.url("/v1/models"), timeout=5, api_key=SecretStr("k3y-value"))
    assert keyed.json()["authorization"] == "Bearer k3y-value"
    assert request("GET", engine.url("/v1/models"), timeout=5).json()["authorization"] is None


def test_the_query_is_kept_and_an_empty_path_is_the_root(engine: EngineStub) -> None:
    assert request("GET", engine.url("/v1/x?a=1&b=two"), timeout=5).json()["path"] == (
        "/v1/x?a=1&b=two"
    )
    assert request("GET", engine.base, timeout=5).json()["path"] == "/"


@pytest.mark.parametrize(
    "url", ["ftp://127.0.0.1/x", "127.0.0.1:8000/v1", "localhost:8000", "http:///v1", ""]
)
def test_a_url_that_is_not_http_is_refused_before_connecting(url: str) -> None:
    with pytest.raises(ValueError, match="not an http"):
        request("GET", url, timeout=1)


def test_a_proxy_in_the_environment_is_not_used(
    engine: EngineStub, refusing_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, refusing_url)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert request("GET", engine.url("/health"), timeout=5).status == 200
    assert engine.seen[0].path == "/health"  # a proxy would be sent the whole URL


def test_a_refused_connection_raises_an_oserror(refusing_url: str) -> None:
    with pytest.raises(ConnectionRefusedError):
        request("GET", refusing_url + "/health", timeout=5)


def test_a_server_slower_than_the_timeout_raises_a_timeout(engine: EngineStub) -> None:
    engine.routes["/slow"] = engine.late
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        request("GET", engine.url("/slow"), timeout=0.3)
    assert 0.25 <= time.monotonic() - started < 3.0


def stream(handler: Handler, pieces: list[bytes], *, gap_s: float = 0.0, end: bool = True) -> None:
    handler.start_stream()
    for piece in pieces:
        handler.chunk(piece)
        if gap_s:
            time.sleep(gap_s)
    if end:
        handler.end_stream()


def test_a_stream_yields_each_data_event_and_ends_at_done(engine: EngineStub) -> None:
    pieces = [
        b": keep-alive comment\n\n",
        b"event: message\n",
        *sse({"id": 1, "choices": [{"delta": {"content": "12"}}]}),
        b"data:" + json.dumps({"id": 2}).encode() + b"\r\n\r\n",  # no space, CRLF
        b"id: 7\nretry: 100\n\n",
        *sse({"id": 3, "usage": {"completion_tokens": 2}}),
        b"data: [DONE]\n\n",
        *sse({"id": "after done"}),
    ]
    engine.routes["/v1/chat/completions"] = lambda h: stream(h, pieces)
    events = list(stream_events(engine.url("/v1/chat/completions"), {"stream": True}, timeout=5))
    assert [event for _, event in events] == [
        {"id": 1, "choices": [{"delta": {"content": "12"}}]},
        {"id": 2},
        {"id": 3, "usage": {"completion_tokens": 2}},
    ]


def test_a_stream_posts_its_body_with_the_key_and_asks_for_events(engine: EngineStub) -> None:
    engine.routes["/v1/completions"] = lambda h: stream(h, [b"data: [DONE]\n\n"])
    body = {"model": "tiny-chat", "prompt": "hi", "stream": True}
    url = engine.url("/v1/completions")
    assert list(stream_events(url, body, timeout=5, api_key=SecretStr("k3y"))) == []
    (seen,) = engine.seen
    assert (seen.method, seen.path) == ("POST", "/v1/completions")
    assert json.loads(seen.body) == body
    assert seen.headers["Authorization"] == "Bearer k3y"
    assert seen.headers["Content-Type"] == "application/json"
    assert seen.headers["Accept"] == "text/event-stream"


def test_a_stream_that_closes_without_done_ends_after_its_events(engine: EngineStub) -> None:
    engine.routes["/s"] = lambda h: stream(h, sse({"n": 1}, {"n": 2}))
    events = [event for _, event in stream_events(engine.url("/s"), {}, timeout=5)]
    assert events == [{"n": 1}, {"n": 2}]


def test_events_are_yielded_as_they_arrive_with_their_arrival_times(engine: EngineStub) -> None:
    engine.routes["/s"] = lambda h: stream(h, sse({"n": 1}, {"n": 2}, {"n": 3}), gap_s=0.2)
    started = time.monotonic()
    arrivals = []
    for arrived, event in stream_events(engine.url("/s"), {}, timeout=5):
        arrivals.append((arrived, event["n"], time.monotonic()))
    assert [n for _, n, _ in arrivals] == [1, 2, 3]
    times = [arrived for arrived, _, _ in arrivals]
    assert started <= times[0] < times[1] < times[2]
    assert times[1] - times[0] >= 0.1
    assert times[2] - times[1] >= 0.1
    assert all(arrived <= handed for arrived, _, handed in arrivals)


def test_a_stream_that_is_refused_raises_with_the_status_and_the_start_of_the_body(
    engine: EngineStub,
) -> None:
    body = b'{"error": "invalid api key"}' + b"x" * 2000
    engine.routes["/v1/chat/completions"] = lambda h: h.reply(401, body)
    url = engine.url("/v1/chat/completions")
    with pytest.raises(http.client.HTTPException) as caught:
        list(stream_events(url, {"stream": True}, timeout=5))
    message = str(caught.value)
    assert message.startswith(f"HTTP 401 from {url}: ")
    assert "invalid api key" in message
    assert "x" * 470 in message
    assert "x" * 480 not in message


def test_a_stalled_stream_times_out_on_its_next_read(engine: EngineStub) -> None:
    def stalled(handler: Handler) -> None:
        stream(handler, sse({"n": 1}), end=False)
        handler.server.stall()

    engine.routes["/s"] = stalled
    events: list[dict[str, Any]] = []
    started = time.monotonic()
    incoming = stream_events(engine.url("/s"), {}, timeout=0.3)
    with pytest.raises(TimeoutError):
        events.extend(event for _, event in incoming)
    assert events == [{"n": 1}]
    assert 0.25 <= time.monotonic() - started < 3.0


def test_a_stream_that_keeps_trickling_is_cut_at_the_whole_timeout(engine: EngineStub) -> None:
    def trickle(handler: Handler) -> None:
        handler.start_stream()
        for n in range(int(WAIT_CAP_S / 0.05)):
            if handler.server.release.is_set():
                return
            handler.chunk(sse({"n": n})[0])
            time.sleep(0.05)

    engine.routes["/s"] = trickle
    url = engine.url("/s")
    events: list[dict[str, Any]] = []
    started = time.monotonic()
    incoming = stream_events(url, {}, timeout=0.5)
    with pytest.raises(TimeoutError, match=re.escape(f"stream from {url} still open after 0.5 s")):
        events.extend(event for _, event in incoming)
    assert 0.5 <= time.monotonic() - started < 3.0
    assert 3 <= len(events) <= 20  # every read was in time: only the whole stream was too long


def test_metrics_are_scraped_from_the_metrics_page(engine: EngineStub) -> None:
    engine.routes["/metrics"] = lambda h: h.reply(200, METRICS_PAGE.encode(), "text/plain")
    scrape = scrape_metrics(engine.base + "/")
    assert scrape.error is None
    assert scrape.metrics == parse_metrics(METRICS_PAGE)
    assert scrape.metrics is not None
    assert scrape.metrics.missing == ()
    (seen,) = engine.seen
    assert (seen.method, seen.path) == ("GET", "/metrics")
    assert "Authorization" not in seen.headers


def test_a_metrics_page_that_is_not_utf8_is_still_read(engine: EngineStub) -> None:
    engine.routes["/metrics"] = lambda h: h.reply(200, METRICS_PAGE.encode() + b"\xff\xfe\n")
    scrape = scrape_metrics(engine.base)
    assert scrape.error is None
    assert scrape.metrics == parse_metrics(METRICS_PAGE)


def test_a_metrics_page_that_fails_is_a_scrape_with_the_status(engine: EngineStub) -> None:
    engine.routes["/metrics"] = lambda h: h.reply(500, b"oops", "text/plain")
    scrape = scrape_metrics(engine.base)
    assert (scrape.metrics, scrape.error) == (None, f"GET {engine.base}/metrics: HTTP 500")


def test_an_engine_that_refuses_is_a_scrape_with_the_reason(refusing_url: str) -> None:
    scrape = scrape_metrics(refusing_url)
    assert scrape.metrics is None
    assert scrape.error is not None
    assert scrape.error.startswith(f"GET {refusing_url}/metrics: ConnectionRefusedError: ")


def test_an_engine_that_hangs_is_a_scrape_with_the_timeout(engine: EngineStub) -> None:
    engine.routes["/metrics"] = engine.late
    started = time.monotonic()
    scrape = scrape_metrics(engine.base, timeout=0.3)
    assert scrape.metrics is None
    assert scrape.error is not None
    assert "TimeoutError" in scrape.error
    assert time.monotonic() - started < 3.0
