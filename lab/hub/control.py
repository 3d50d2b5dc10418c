"""HubControl: a lab hub in another process, driven over its /_lab/ endpoints."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from lab.hub.faults import Faults
from lab.hub.request_log import RequestRecord


class HubControl:
    """A lab hub running in another process (`python -m lab.hub`, the lab's), driven over its
    /_lab/ endpoints: the fault switches and the request log of HubServer."""

    def __init__(self, url: str, *, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._timeout_s = timeout_s

    def _call(self, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.url}/_lab/{path}",
            data=data,
            method="GET" if body is None else "POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as reply:
                answer: dict[str, Any] = json.loads(reply.read())
        except urllib.error.HTTPError as error:
            raise RuntimeError(
                f"lab hub {self.url}/_lab/{path}: HTTP {error.code} {error.read()[:300]!r}"
            ) from error
        return answer

    def set_faults(self, **request: Any) -> Faults:
        """POST /_lab/faults (the keys of HubServer.apply_fault_request); the faults now."""
        return Faults(**self._call("faults", request))

    def stats(self) -> dict[str, Any]:
        return self._call("stats")

    def reset_stats(self) -> None:
        self._call("stats", {"reset": True})

    def requests(self) -> list[RequestRecord]:
        return [RequestRecord(**record) for record in self.stats()["log"]]

    def authorization_by_origin(self) -> dict[str, list[str]]:
        by_origin: dict[str, list[str]] = self.stats()["authorization"]
        return by_origin
