"""tasks.artifacts on a Prefect test server: artifacts written in the background are there, in
order and linked to their task run, when a flow of ours ends; a write that fails is a warning in
the run's log, not a failed step."""

from __future__ import annotations

import importlib
import pkgutil
from uuid import UUID

import pytest
from prefect import Flow, State, flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.sorting import ArtifactSort
from prefect.context import TaskRunContext
from prefect.logging.handlers import APILogHandler

import flows
from tasks.artifacts import artifacts_written, publish_markdown, publish_table

pytestmark = pytest.mark.usefixtures("prefect_harness")


@task
def record(keys: list[str]) -> str:
    for number, key in enumerate(keys):
        publish_table(key=key, table=[{"row": number}], description=f"table {number}")
    publish_markdown(key="artifacts-test-notes", markdown="# done", description="notes")
    context = TaskRunContext.get()
    assert context is not None
    return str(context.task_run.id)


@flow(on_completion=[artifacts_written], on_failure=[artifacts_written])
def recording(keys: list[str]) -> str:
    return record(keys)


def _run(keys: list[str]) -> tuple[UUID, str]:
    state: State[str] = recording(keys, return_state=True)
    assert state.is_completed(), state
    run_id = state.state_details.flow_run_id
    assert run_id is not None
    return run_id, state.result()


def test_a_flow_ends_with_its_artifacts_written_in_order_and_linked_to_their_task() -> None:
    keys = [f"artifacts-test-{number}" for number in range(5)]
    run_id, task_run_id = _run(keys)
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])),
            sort=ArtifactSort.CREATED_DESC,
        )
    assert [a.key for a in reversed(found)] == [*keys, "artifacts-test-notes"]
    assert {str(a.task_run_id) for a in found} == {task_run_id}
    assert found[0].data == "# done"


def test_a_write_that_fails_is_a_warning_and_the_step_goes_on() -> None:
    run_id, _ = _run(["Not A Valid Key!", "artifacts-test-after"])
    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
        )
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    assert {a.key for a in found} == {"artifacts-test-after", "artifacts-test-notes"}
    assert any("artifact 'Not A Valid Key!' not written" in log.message for log in logs), [
        log.message for log in logs
    ]


def test_every_flow_of_ours_waits_for_its_artifacts() -> None:
    ours = [
        value
        for module in pkgutil.iter_modules(flows.__path__)
        for value in vars(importlib.import_module(f"flows.{module.name}")).values()
        if isinstance(value, Flow)
    ]
    assert len({f.name for f in ours}) >= 8
    for each in ours:
        assert artifacts_written in each.on_completion_hooks, each.name
        assert artifacts_written in each.on_failure_hooks, each.name
