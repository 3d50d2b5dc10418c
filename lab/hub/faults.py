"""The hub's fault switches: the next requests failed (a status, a rate limit), the next file
body cut, every body slowed."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_RETRY_AFTER_S = 1


@dataclass
class Faults:
    fail_remaining: int = 0
    fail_status: int = 503
    # Sent as Retry-After with the injected failures (a 429 always has one).
    retry_after_s: int | None = None
    cut_after_bytes: int | None = None
    slow_bytes_per_s: int | None = None


class FaultSwitches:
    """The faults in force, set from the tests or POST /_lab/faults and taken by the requests
    they strike, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults = Faults()

    def fail_next(self, n: int, status: int = 503, retry_after_s: int | None = None) -> None:
        with self._lock:
            self._faults.fail_remaining = n
            self._faults.fail_status = status
            self._faults.retry_after_s = retry_after_s

    def cut_next_file(self, after_bytes: int) -> None:
        with self._lock:
            self._faults.cut_after_bytes = after_bytes

    def slow(self, bytes_per_s: int | None) -> None:
        with self._lock:
            self._faults.slow_bytes_per_s = bytes_per_s or None

    def reset(self) -> None:
        with self._lock:
            self._faults = Faults()

    def current(self) -> Faults:
        with self._lock:
            return Faults(**asdict(self._faults))

    def apply_request(self, request: Mapping[str, Any]) -> None:
        """Apply a POST /_lab/faults body; ValueError names what is wrong."""
        known = {"reset", "fail_next", "status", "retry_after", "cut_next_file", "slow"}
        unknown = sorted(set(request) - known)
        if unknown:
            raise ValueError(f"unknown fault keys {unknown}; known: {sorted(known)}")
        for key in ("fail_next", "status", "retry_after", "cut_next_file", "slow"):
            value = request.get(key)
            nullable = key in ("slow", "retry_after")
            if key in request and not (
                (nullable and value is None)
                or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
            ):
                raise ValueError(f"fault {key}: expected a non-negative integer, got {value!r}")
        for key in ("status", "retry_after"):
            if key in request and "fail_next" not in request:
                raise ValueError(f"fault {key}: only meaningful with fail_next")
        if request.get("reset"):
            self.reset()
        if "fail_next" in request:
            self.fail_next(
                request["fail_next"], request.get("status", 503), request.get("retry_after")
            )
        if "cut_next_file" in request:
            self.cut_next_file(request["cut_next_file"])
        if "slow" in request:
            self.slow(request["slow"])

    def take_failure(self) -> tuple[int, int | None] | None:
        """(status, Retry-After seconds) of the next injected failure, if one is due."""
        with self._lock:
            if self._faults.fail_remaining <= 0:
                return None
            self._faults.fail_remaining -= 1
            retry_after = self._faults.retry_after_s
            if retry_after is None and self._faults.fail_status == 429:
                retry_after = DEFAULT_RETRY_AFTER_S
            return self._faults.fail_status, retry_after

    def take_cut(self) -> int | None:
        with self._lock:
            cut, self._faults.cut_after_bytes = self._faults.cut_after_bytes, None
            return cut
