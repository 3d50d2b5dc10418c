"""What every task module shares: retry conditions and artifact keys
(sparkdeploy.report.history).

A task (or flow) whose result holds a recipe's secrets (a Plan: its SecretStr values pickle in
clear) is declared with persist_result=False and cache_policy=NO_CACHE. Prefect persists no
result by default, but a server or worker with PREFECT_RESULTS_PERSIST_BY_DEFAULT=true would
write that pickle to its result storage, and a cached plan would hand a later call the secrets
(and the recipe) of an earlier one. tests/test_result_storage.py finds every such task by its
return type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import Task
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from sparkdeploy.report.history import artifact_key

__all__ = ["RetryCondition", "artifact_key", "retry_only"]

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
