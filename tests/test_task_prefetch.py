"""tasks.prefetch on a Prefect test server against the lab hub: artifacts, logs, retries only
for transient failures, and the hub token kept out of everything Prefect records."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from prefect import State, flow
from prefect.blocks.system import Secret
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.objects import Artifact, Log
from prefect.logging.handlers import APILogHandler

from lab.hub.server import HubServer
from lab.tinymodel import generate_repo
from sparkdeploy.errors import PrefetchError
from sparkdeploy.steps.prefetch import RepoOutcome, RepoSpec
from tasks.artifacts import artifacts_written
from tasks.prefetch import FILES_ARTIFACT_KEY, PROGRESS_ARTIFACT_KEY, prefetch_repos

TINY = "lab-org/tiny"
GATED = "lab-org/gated"
TOKEN = "hf_lab_s3cret_token_value"


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubServer]:
    repos = tmp_path / "repos"
    generate_repo(repos, TINY, num_shards=2, total_bytes=2 << 20)
    generate_repo(repos, GATED, total_bytes=64 << 10, gated_tokens=[TOKEN])
    with HubServer(repos) as server:
        yield server


pytestmark = pytest.mark.usefixtures("prefect_harness")
pytest_plugins = ["prefetch_fixtures"]


@flow(on_completion=[artifacts_written], on_failure=[artifacts_written])
def prefetch_flow(repos: list[RepoSpec], nas: str, endpoint: str) -> list[RepoOutcome]:
    task = prefetch_repos.with_options(retry_delay_seconds=0)
    return task(repos, nas, endpoint=endpoint, max_workers=2, allow_http_token=True)


def run_flow(repos: list[RepoSpec], nas: Path, hub: HubServer) -> tuple[list[RepoOutcome], str]:
    """The flow's result and every log line it sent to the server."""
    state: State[list[RepoOutcome]] = prefetch_flow(repos, str(nas), hub.url, return_state=True)
    APILogHandler().flush()
    run_id = state.state_details.flow_run_id
    assert run_id is not None
    logs = asyncio.run(_logs(run_id))
    return state.result(), "\n".join(log.message for log in logs)


async def _artifacts(key: str) -> list[Artifact]:
    async with get_client() as client:
        return await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
        )


async def _logs(flow_run_id: UUID) -> list[Log]:
    async with get_client() as client:
        return await client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200
        )


def latest_artifact(key: str) -> Artifact:
    return max(asyncio.run(_artifacts(key)), key=lambda a: a.created or 0)


def table_rows() -> list[dict[str, Any]]:
    data = latest_artifact(FILES_ARTIFACT_KEY).data
    assert isinstance(data, str)
    rows: list[dict[str, Any]] = json.loads(data)
    return rows


def test_cold_then_warm_with_artifacts(hub: HubServer, nas: Path) -> None:
    [cold], logs = run_flow([RepoSpec(TINY)], nas, hub)
    assert cold.fetched_bytes == cold.total_bytes == hub.bytes_served
    rows = table_rows()
    assert {row["file"] for row in rows} == {f.path for f in cold.files}
    assert {row["status"] for row in rows} == {"fetched"}
    assert latest_artifact(PROGRESS_ARTIFACT_KEY).data == 100.0
    assert "prefetch lab-org/tiny: 2.0 MiB of 2.0 MiB (100%)" in logs
    assert "ETA 0 s" in logs

    hub.reset_stats()
    [warm], logs = run_flow([RepoSpec(TINY)], nas, hub)
    assert warm.fetched_bytes == 0
    assert hub.bytes_served == 0
    assert {row["status"] for row in table_rows()} == {"cached"}
    assert "complete in the NAS cache" in logs


def test_transient_failure_is_retried(hub: HubServer, nas: Path) -> None:
    hub.fail_next(1, 503)
    [outcome], _ = run_flow([RepoSpec(TINY)], nas, hub)
    assert outcome.fetched_bytes == outcome.total_bytes
    assert [r.status for r in hub.requests()][:2] == [503, 200]


def test_missing_repo_is_not_retried(hub: HubServer, nas: Path) -> None:
    with pytest.raises(PrefetchError, match="lab-org/nope@main not found"):
        prefetch_flow([RepoSpec("lab-org/nope")], str(nas), hub.url)
    assert hub.request_count == 1


def test_token_comes_from_the_secret_block_and_is_never_recorded(hub: HubServer, nas: Path) -> None:
    Secret(value=TOKEN).save("hf-token", overwrite=True)
    try:
        [outcome], logs = run_flow([RepoSpec(GATED)], nas, hub)
    finally:
        asyncio.run(_delete_secret())
    assert outcome.fetched_bytes == outcome.total_bytes
    assert all(r.authorized for r in hub.requests() if "/resolve/" in r.path)
    assert "(authenticated)" in logs
    assert TOKEN not in logs
    for key in (FILES_ARTIFACT_KEY, PROGRESS_ARTIFACT_KEY):
        for artifact in asyncio.run(_artifacts(key)):
            assert TOKEN not in str(artifact.data)
            assert TOKEN not in str(artifact.description)


async def _delete_secret() -> None:
    async with get_client() as client:
        block = await client.read_block_document_by_name("hf-token", block_type_slug="secret")
        await client.delete_block_document(block.id)
