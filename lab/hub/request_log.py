"""The hub's two origins and its request log: every request (lab control aside) with its status,
body bytes and Authorization fingerprint, and the totals the lab's tests read."""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any

HUB = "hub"
STORAGE = "storage"
REQUEST_LOG_LENGTH = 10_000


def fingerprint(authorization: str) -> str:
    """How the request log names an Authorization header: a digest, never the token itself."""
    return hashlib.sha256(authorization.encode()).hexdigest()[:16]


@dataclass
class RequestRecord:
    """One request; status and bytes_sent are filled in before the client can see them.

    `origin` is the address it reached (HUB or STORAGE); `authorization` the fingerprint of its
    Authorization header, if it had one.
    """

    method: str
    path: str
    range: str | None
    authorized: bool
    origin: str = HUB
    authorization: str | None = None
    status: int = 0
    bytes_sent: int = 0


class RequestLog:
    """The latest requests and the totals since start (or the last reset), thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._log: deque[RequestRecord] = deque(maxlen=REQUEST_LOG_LENGTH)
        self._request_count = 0
        self._bytes_served = 0

    @property
    def bytes_served(self) -> int:
        with self._lock:
            return self._bytes_served

    @property
    def request_count(self) -> int:
        with self._lock:
            return self._request_count

    def requests(self) -> list[RequestRecord]:
        with self._lock:
            return [replace(record) for record in self._log]

    def reset(self) -> None:
        with self._lock:
            self._log.clear()
            self._request_count = 0
            self._bytes_served = 0

    def begin(self, record: RequestRecord) -> None:
        with self._lock:
            self._log.append(record)
            self._request_count += 1

    def set_status(self, record: RequestRecord, status: int) -> None:
        with self._lock:
            record.status = status

    def count_bytes(self, record: RequestRecord, count: int) -> None:
        """Add count body bytes (negative to take back bytes counted but never sent)."""
        with self._lock:
            record.bytes_sent += count
            self._bytes_served += count

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": self._request_count,
                "bytes_served": self._bytes_served,
                "authorization": self._authorization_by_origin(),
                "log": [asdict(record) for record in self._log],
            }

    def authorization_by_origin(self) -> dict[str, list[str]]:
        with self._lock:
            return self._authorization_by_origin()

    def _authorization_by_origin(self) -> dict[str, list[str]]:
        seen: dict[str, list[str]] = {HUB: [], STORAGE: []}
        for record in self._log:
            if record.authorization and record.authorization not in seen[record.origin]:
                seen[record.origin].append(record.authorization)
        return seen
