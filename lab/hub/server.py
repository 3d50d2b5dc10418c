"""HubServer: the lab hub's two origins (the hub and its storage host) served by threads of this
process, with the storage URLs it signs, its fault switches and its request log."""

from __future__ import annotations

import contextlib
import hmac
import os
import socket
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

from lab.hub.faults import DEFAULT_RETRY_AFTER_S, Faults, FaultSwitches
from lab.hub.handler import HubHandler
from lab.hub.index import HubFile, RepoIndex
from lab.hub.request_log import HUB, STORAGE, RequestLog, RequestRecord

# How long a storage URL the hub hands out stays valid (the real hub's are signed for about an
# hour).
STORAGE_URL_LIFETIME_S = 3600


class HubServer:
    """The lab hub in threads of this process (or, via `python -m lab.hub`, as its own process):
    the hub's address and the storage host's, by default the same host on another port."""

    def __init__(
        self,
        repos_dir: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        page_size: int = 1000,
        storage_host: str | None = None,
        storage_port: int = 0,
    ) -> None:
        self.repos_dir = Path(repos_dir)
        self.index = RepoIndex(self.repos_dir)
        self.page_size = page_size
        self.fault_switches = FaultSwitches()
        self.request_log = RequestLog()
        self._addresses = {HUB: (host, port), STORAGE: (storage_host or host, storage_port)}
        self._signing_key = os.urandom(32)
        self._servers: dict[str, HubHTTPServer] = {}
        self._threads: list[threading.Thread] = []

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> HubServer:
        if self._servers:
            return self
        try:
            for origin, address in self._addresses.items():
                httpd = HubHTTPServer(address, HubHandler)
                httpd.hub = self
                httpd.origin = origin
                self._servers[origin] = httpd
        except OSError:
            self._close_servers()
            raise
        for origin, httpd in self._servers.items():
            thread = threading.Thread(
                target=httpd.serve_forever,
                kwargs={"poll_interval": 0.1},
                name=f"lab-{origin}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        for httpd in self._servers.values():
            httpd.shutdown()
            httpd.close_connections()
        self._close_servers()
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads.clear()

    def _close_servers(self) -> None:
        for httpd in self._servers.values():
            httpd.server_close()
        self._servers.clear()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The hub's address: the endpoint clients are given."""
        return self._url_of(HUB)

    @property
    def storage_url(self) -> str:
        """The storage host's address, where the hub redirects LFS downloads."""
        return self._url_of(STORAGE)

    def _url_of(self, origin: str) -> str:
        httpd = self._servers.get(origin)
        if httpd is None:
            raise RuntimeError("the lab hub is not started: call start() first")
        host, port = httpd.socket.getsockname()[:2]
        return f"http://{host}:{port}"

    def storage_location(self, repo_id: str, hub_file: HubFile) -> str:
        """A signed URL of the LFS file on the storage host, as the hub's 302 gives it."""
        expires = int(time.time()) + STORAGE_URL_LIFETIME_S
        path = f"/lfs/{repo_id}/{hub_file.sha256}"
        name = quote(hub_file.path.rsplit("/", 1)[-1], safe="")
        return (
            f"{self.storage_url}{path}?filename={name}&expires={expires}"
            f"&signature={self._signature(path, expires)}"
        )

    def _signature(self, path: str, expires: int) -> str:
        return hmac.new(self._signing_key, f"{path}\n{expires}".encode(), "sha256").hexdigest()

    def signature_valid(self, path: str, expires: str, signature: str) -> bool:
        if not expires.isdigit() or int(expires) < time.time():
            return False
        return hmac.compare_digest(self._signature(path, int(expires)), signature)

    # --- fault switches --------------------------------------------------------------------

    def fail_next(self, n: int, status: int = 503, retry_after_s: int | None = None) -> None:
        """The next n requests to either origin (lab control aside) are answered with `status`,
        with a Retry-After header when retry_after_s is given (a 429 always has one)."""
        self.fault_switches.fail_next(n, status, retry_after_s)

    def rate_limit(self, n: int, retry_after_s: int = DEFAULT_RETRY_AFTER_S) -> None:
        """The next n requests are answered 429 Too Many Requests, as the real hub's rate
        limit answers: Retry-After and the RateLimit headers."""
        self.fault_switches.fail_next(n, 429, retry_after_s)

    def cut_next_file(self, after_bytes: int) -> None:
        """The next file body is cut (connection closed) after `after_bytes` bytes."""
        self.fault_switches.cut_next_file(after_bytes)

    def slow(self, bytes_per_s: int | None) -> None:
        """File bodies are sent at most this fast per response (None: full speed)."""
        self.fault_switches.slow(bytes_per_s)

    def reset_faults(self) -> None:
        self.fault_switches.reset()

    def faults(self) -> Faults:
        return self.fault_switches.current()

    def apply_fault_request(self, request: Mapping[str, Any]) -> None:
        """Apply a POST /_lab/faults body; ValueError names what is wrong."""
        self.fault_switches.apply_request(request)

    # --- statistics ------------------------------------------------------------------------

    @property
    def bytes_served(self) -> int:
        """Body bytes of files sent since start (or the last reset_stats)."""
        return self.request_log.bytes_served

    @property
    def request_count(self) -> int:
        return self.request_log.request_count

    def requests(self) -> list[RequestRecord]:
        """The latest requests (lab control aside), oldest first."""
        return self.request_log.requests()

    def reset_stats(self) -> None:
        self.request_log.reset()

    def stats(self) -> dict[str, Any]:
        return self.request_log.stats()

    def authorization_by_origin(self) -> dict[str, list[str]]:
        """Per origin, the fingerprints (fingerprint()) of the Authorization headers it was
        sent, in the order first seen (from the request log: since start or reset_stats)."""
        return self.request_log.authorization_by_origin()

    def repo_sha(self, repo_id: str) -> str:
        """The commit sha the hub serves for a repo now."""
        state = self.index.state(repo_id)
        if state is None:
            raise FileNotFoundError(f"no repo {repo_id} under {self.repos_dir}")
        return state.sha


class HubHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    hub: HubServer
    origin: str

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()

    def track(self, connection: socket.socket, open_: bool) -> None:
        with self._connections_lock:
            if open_:
                self._connections.add(connection)
            else:
                self._connections.discard(connection)

    def close_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
