"""Waiting for something to happen, for the tests and the benchmarks: a process to start, a run
to take a lock, a log line to appear."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

Found = TypeVar("Found")


def wait_for(
    what: str, found: Callable[[], Found | None], *, timeout_s: float, poll_s: float
) -> Found:
    """found()'s first truthy answer, asked every poll_s; TimeoutError naming `what` when none
    came within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not (answer := found()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(poll_s)
    return answer
