"""HTTP over a unix socket: the lab talks to each node's dockerd through its socket file.

The node's /run is a bind of a directory on the host, so its docker.sock is reachable from the
host without SSH; the lab uses that for readiness and for removing containers at teardown.
"""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from typing import Any


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(str(self._socket_path))
        self.sock = sock


def request(socket_path: Path, method: str, path: str, *, timeout: float) -> tuple[int, bytes]:
    """One request; raises OSError when nothing listens on the socket."""
    connection = _UnixConnection(socket_path, timeout)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def request_json(socket_path: Path, method: str, path: str, *, timeout: float) -> Any:
    status, body = request(socket_path, method, path, timeout=timeout)
    if status >= 400:
        raise OSError(f"{method} {path} on {socket_path} answered {status}: {body[-300:]!r}")
    return json.loads(body) if body else None
