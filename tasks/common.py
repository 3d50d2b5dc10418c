"""What every task module shares: the retry options of a step that may meet a blip, artifact keys
(sparkdeploy.report.history), and what a gate (smoke test, quality) does with its report.

A task (or flow) whose result holds a recipe's secrets (a Plan: its SecretStr values pickle in
clear) is declared with persist_result=False and cache_policy=NO_CACHE. Prefect persists no
result by default, but a server or worker with PREFECT_RESULTS_PERSIST_BY_DEFAULT=true would
write that pickle to its result storage, and a cached plan would hand a later call the secrets
(and the recipe) of an earlier one. tests/test_result_storage.py finds every such task by its
return type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sized
from typing import Any, Protocol, TypedDict

from prefect import State, Task
from prefect.client.schemas.objects import TaskRun
from prefect.logging import get_run_logger

from sparkdeploy.report.history import artifact_key
from sparkdeploy.spec.plan import Plan
from tasks.artifacts import publish_table

__all__ = [
    "GateReport",
    "Retries",
    "RetryCondition",
    "artifact_key",
    "publish_gate_report",
    "retried_on",
]

RetryCondition = Callable[[Task[Any, Any], TaskRun, State[Any]], bool]


class Retries(TypedDict):
    """Prefect task() options: how often a failed run is tried again, after how long, on what."""

    retries: int
    retry_delay_seconds: list[float]
    retry_condition_fn: RetryCondition


def retried_on(transient: type[BaseException], *delays_s: float) -> Retries:
    """A task's retries (`@task(..., **retried_on(TransientRemoteError, 5, 30))`): one after each
    of the delays, and only when the run failed with a `transient` error."""
    return Retries(
        retries=len(delays_s),
        retry_delay_seconds=list(delays_s),
        retry_condition_fn=_retry_only(transient),
    )


def _retry_only(transient: type[BaseException]) -> RetryCondition:
    """A retry_condition_fn that retries only `transient` errors: a connection reset,
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


class GateReport(Protocol):
    """A gate's report (SmokeReport, QualityReport) as its task shows it."""

    @property
    def passed(self) -> bool: ...

    @property
    def failed(self) -> Sized: ...

    def table_rows(self) -> list[dict[str, str]]: ...

    def raise_if_failed(self) -> None: ...


def publish_gate_report(
    plan: Plan,
    report: GateReport,
    outcomes: Iterable[tuple[bool, str]],
    *,
    key: str,
    title: str,
    unit: str,
    raise_on_failure: bool,
) -> None:
    """The gate's table artifact (`<key>-<deployment>`, described as `title` of the endpoint,
    counting failed `unit`s), a pass/FAIL log line per (passed, text) outcome, then its failure
    raised unless raise_on_failure is off."""
    verdict = f"every {unit} passed" if report.passed else f"{len(report.failed)} {unit}(s) FAILED"
    publish_table(
        key=artifact_key(key, plan.deployment_id),
        table=report.table_rows(),
        description=(
            f"{title} of {plan.served_model_name!r} at {plan.endpoint} ({plan.recipe}): {verdict}"
        ),
    )
    logger = get_run_logger()
    for passed, text in outcomes:
        log = logger.info if passed else logger.error
        log("%s %s", "pass" if passed else "FAIL", text)
    if raise_on_failure:
        report.raise_if_failed()
