"""Prefect's API as the node locks call it: busy answers and transport errors retried here, on a
short schedule of our own."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import httpx

# Variables read per request when paging through holder records or wait tickets.
_VARIABLE_PAGE = 200
_HTTP_BUSY = frozenset({429, 503})
# How long a lock call retries Prefect's busy answers, and its first wait.
API_BUSY_RETRY_S = 30.0
API_BUSY_FIRST_WAIT_S = 0.05

T = TypeVar("T")
P = ParamSpec("P")


def _api(call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`call(*args, **kwargs)`, retried on Prefect's busy answers (429, 503) and on transport
    errors after short, growing waits. The lock calls' client sends each request once
    (sparkdeploy.remote.prefect_api.single_attempt_client), so a busy answer is retried here
    alone, not also by Prefect's client, which waits about 2 s on one even with its retries
    off."""
    deadline = time.monotonic() + API_BUSY_RETRY_S
    delay = API_BUSY_FIRST_WAIT_S
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
        delay = min(delay * 2, 1.0)
