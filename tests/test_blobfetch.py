"""sparkdeploy.remote.blobfetch against tiny loopback servers that misbehave in ways the lab hub
does not: Range ignored, a redirect loop, an error status with the hub's reason."""

from __future__ import annotations

import email.utils
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from sparkdeploy.remote import blobfetch

DATA = os.urandom(3 << 20)

Respond = Callable[[BaseHTTPRequestHandler], None]


@pytest.fixture
def serve() -> Iterator[Callable[[Respond], str]]:
    servers: list[tuple[ThreadingHTTPServer, threading.Thread]] = []

    def start(respond: Respond) -> str:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                respond(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        servers.append((server, thread))
        return f"http://127.0.0.1:{server.server_address[1]}/file"

    yield start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def fetch(url: str, partial: Path, **options: Any) -> str:
    with blobfetch.Connections(
        timeout_s=10, token=None, token_origin=blobfetch.origin_of(url)
    ) as connections:
        return blobfetch.fetch(
            connections,
            url,
            partial,
            size=len(DATA),
            new_digest=hashlib.sha256,
            attempts=options.pop("attempts", 2),
            backoff_s=0.01,
            max_retry_after_s=0.0,
            on_bytes=lambda _n: None,
            on_retry=lambda *_: None,
        )


def whole_file_always(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(DATA)))
    handler.end_headers()
    handler.wfile.write(DATA)


def test_a_server_that_ignores_range_restarts_the_partial(
    serve: Callable[[Respond], str], tmp_path: Path
) -> None:
    partial = tmp_path / "blob.incomplete"
    partial.write_bytes(b"not the file's first bytes")
    digest = fetch(serve(whole_file_always), partial)
    assert digest == hashlib.sha256(DATA).hexdigest()
    assert partial.read_bytes() == DATA


def test_a_partial_longer_than_the_file_starts_over(
    serve: Callable[[Respond], str], tmp_path: Path
) -> None:
    partial = tmp_path / "blob.incomplete"
    partial.write_bytes(DATA + b"tail")
    assert fetch(serve(whole_file_always), partial) == hashlib.sha256(DATA).hexdigest()
    assert partial.read_bytes() == DATA


def test_a_redirect_loop_is_an_error(serve: Callable[[Respond], str], tmp_path: Path) -> None:
    def loop(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.send_header("Location", "/file")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    with pytest.raises(blobfetch.ProtocolError, match="more than 5 redirects"):
        fetch(serve(loop), tmp_path / "blob.incomplete")


def test_an_error_status_carries_the_hub_reason(
    serve: Callable[[Respond], str], tmp_path: Path
) -> None:
    def forbidden(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(403)
        handler.send_header("X-Error-Message", "Access to model x/y is restricted")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    with pytest.raises(blobfetch.HttpStatusError, match="restricted") as raised:
        fetch(serve(forbidden), tmp_path / "blob.incomplete")
    assert raised.value.status == 403


def test_a_wrong_size_is_an_error_not_a_retry(
    serve: Callable[[Respond], str], tmp_path: Path
) -> None:
    def short(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", "10")
        handler.end_headers()
        handler.wfile.write(DATA[:10])

    with pytest.raises(blobfetch.ProtocolError, match="announces 10 bytes"):
        fetch(serve(short), tmp_path / "blob.incomplete")


def test_retry_after_is_read_as_seconds_or_an_http_date() -> None:
    assert blobfetch.retry_after_s({"Retry-After": "7"}) == 7.0
    later = email.utils.formatdate(time.time() + 60, usegmt=True)
    wait = blobfetch.retry_after_s({"Retry-After": later})
    assert wait is not None
    assert 50 < wait <= 60
    assert blobfetch.retry_after_s({"Retry-After": "soon"}) is None
    assert blobfetch.retry_after_s({}) is None
