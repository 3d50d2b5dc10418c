"""Prefect's API as the node locks call it: busy answers and transport errors retried for
API_BUSY_RETRY_S (sparkdeploy.remote.prefect_api.retried_when_busy)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar

from sparkdeploy.remote.prefect_api import retried_when_busy

# Variables read per request when paging through holder records or wait tickets.
_VARIABLE_PAGE = 200
# How long a lock call retries Prefect's busy answers: a deploy waiting for its nodes can wait.
API_BUSY_RETRY_S = 30.0

T = TypeVar("T")
P = ParamSpec("P")


def _api(call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`call(*args, **kwargs)`, retried on Prefect's busy answers for API_BUSY_RETRY_S. The lock
    calls' client sends each request once (single_attempt_client), so a busy answer is retried
    here alone, not also by Prefect's client, which waits about 2 s on one even with its retries
    off."""
    return retried_when_busy(API_BUSY_RETRY_S, call, *args, **kwargs)
