"""A step's artifact, written off the step's path.

Writing an artifact is a round trip to the Prefect server (tens of milliseconds on this lab, and
a deploy writes nine) that the next step has no reason to wait for. `publish_table` and
`publish_markdown` hand the write to one thread, in the context of the task that asked, so that
the artifact is linked to its task and flow runs as if written in place
(https://docs.prefect.io/v3/develop/artifacts), and the writes go out in the order asked.

Every flow of ours waits for them before it ends (`artifacts_written` is its `on_completion` and
`on_failure` hook); a flow of someone else's that runs these tasks calls `wait_for_artifacts()`
at its end. A write that fails is a warning in the run's log: the record
is lost, not the step.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from prefect import Flow, State
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.schemas.objects import FlowRun
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger

_LOG = logging.getLogger(__name__)
_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparkdeploy-artifacts")
_pending: list[Future[None]] = []
_pending_lock = threading.Lock()


def _write(create: Callable[..., object], fields: Mapping[str, Any]) -> None:
    try:
        create(**fields)
    except Exception as error:
        try:
            logger: logging.Logger | logging.LoggerAdapter[logging.Logger] = get_run_logger()
        except MissingContextError:
            logger = _LOG
        logger.warning("artifact %r not written: %s", fields.get("key"), error)


def _publish(create: Callable[..., object], fields: Mapping[str, Any]) -> None:
    context = contextvars.copy_context()
    future = _writer.submit(context.run, _write, create, fields)
    with _pending_lock:
        # Written ones are dropped here: a long-lived process that publishes outside our flows
        # (and so never waits) keeps only the writes still to do.
        _pending[:] = [pending for pending in _pending if not pending.done()]
        _pending.append(future)


def publish_table(*, key: str, table: list[dict[str, Any]], description: str) -> None:
    """A table artifact of the current task run, written in the background."""
    _publish(create_table_artifact, {"key": key, "table": table, "description": description})


def publish_markdown(*, key: str, markdown: str, description: str) -> None:
    """A markdown artifact of the current task run, written in the background."""
    _publish(
        create_markdown_artifact, {"key": key, "markdown": markdown, "description": description}
    )


def wait_for_artifacts() -> None:
    """Return once every artifact published so far is written (or its failure logged)."""
    with _pending_lock:
        pending = list(_pending)
        _pending.clear()
    for future in pending:
        future.result()


def artifacts_written(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    """A flow hook (https://docs.prefect.io/v3/develop/manage-states#state-change-hooks): the
    run ends once its artifacts are written."""
    wait_for_artifacts()
