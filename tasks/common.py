"""What every task module shares: retry conditions and artifact keys."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from prefect import Task
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

RetryCondition = Callable[[Task[Any, Any], TaskRun, State[Any]], bool]


def retry_only(*transient: type[BaseException]) -> RetryCondition:
    """A retry_condition_fn that retries only the given (transient) errors: a connection reset,
    a timeout, a 5xx; never a missing file, a full disk, a 404 or a bad input."""

    def condition(task: Task[Any, Any], task_run: TaskRun, state: State[Any]) -> bool:
        try:
            state.result()
        except transient:
            return True
        except Exception:
            return False
        return False

    return condition


def artifact_key(prefix: str, name: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return f"{prefix}-" + re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
