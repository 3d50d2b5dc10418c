"""The readiness-gate and smoke-test Prefect tasks in a flow on a Prefect test server, against
engine stand-in containers on the lab: their artifacts on a good boot, a failed boot (the
timeline is still written, the run fails with BootFailed, no retry) and a failed smoke test."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from readiness_lab import Deployment, lab_plan

from lab.cluster import Lab
from sparkdeploy.errors import BootFailed, SmokeFailed
from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.readiness_gate import GateResult
from sparkdeploy.steps.smoke_test import SmokeReport, SmokeSettings
from tasks.artifacts import artifacts_written
from tasks.common import artifact_key
from tasks.readiness_gate import readiness_gate
from tasks.smoke_test import smoke_test

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]

BOOT_S = 90.0
ENGINE_FLAGS = (
    "--reasoning-parser",
    "glm45",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "glm47",
)
SMOKE_OPTIONS = '[smoke]\nchat_template_kwargs = { reasoning_effort = "low" }\nmax_tokens = 256'


@flow(on_completion=[artifacts_written], on_failure=[artifacts_written])
def gate_then_smoke(plan: Plan) -> tuple[GateResult, SmokeReport]:
    result = readiness_gate(plan, timeout_s=BOOT_S)
    return result, smoke_test(plan, request_timeout_s=10.0)


def deploy(
    lab: Lab, tmp_path: Path, started: list[Deployment], *, nodes: int, fault: str = ""
) -> Plan:
    name = f"task-{secrets.token_hex(3)}"
    plan = lab_plan(
        lab,
        tmp_path / "recipes",
        name,
        nodes=nodes,
        fault=fault,
        args=ENGINE_FLAGS,
        smoke=SMOKE_OPTIONS,
    )
    deployment = Deployment(plan)
    started.append(deployment)
    deployment.start()
    return plan


async def _artifact_rows(key: str) -> list[dict[str, str]]:
    async with get_client() as client:
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
        )
    assert len(artifacts) == 1, f"expected one artifact {key!r}, got {len(artifacts)}"
    data: Any = artifacts[0].data
    rows = json.loads(data) if isinstance(data, str) else data
    assert isinstance(rows, list), rows
    return rows


def artifact_rows(key: str) -> list[dict[str, str]]:
    return asyncio.run(_artifact_rows(key))


def test_smoke_settings_follow_the_head_flags_and_the_recipe(
    lab_cluster: Lab, tmp_path: Path
) -> None:
    with_flags = lab_plan(
        lab_cluster, tmp_path, "flags", nodes=2, args=ENGINE_FLAGS, smoke=SMOKE_OPTIONS
    )
    settings = SmokeSettings.for_plan(with_flags)
    assert (settings.tool_calls, settings.reasoning) == (True, True)
    assert dict(settings.chat_template_kwargs) == {"reasoning_effort": "low"}
    assert (settings.max_tokens, settings.base_url) == (256, with_flags.endpoint)
    plain = SmokeSettings.for_plan(lab_plan(lab_cluster, tmp_path, "plain", nodes=1))
    assert (plain.tool_calls, plain.reasoning, dict(plain.chat_template_kwargs)) == (
        False,
        False,
        {},
    )


def test_a_good_boot_writes_its_timeline_and_passes_the_smoke_test(
    lab_cluster: Lab, tmp_path: Path, deployments: list[Deployment]
) -> None:
    plan = deploy(lab_cluster, tmp_path, deployments, nodes=2)
    result, report = gate_then_smoke(plan)
    assert report.passed
    assert {"tool_call", "reasoning"} <= {c.name for c in report.checks}
    timeline = artifact_rows(artifact_key("readiness-gate", plan.deployment_id))
    assert [row["marker"] for row in timeline] == [entry.marker for entry in result.timeline]
    by_marker = {row["marker"]: row for row in timeline}
    assert by_marker["headless_worker_joined"]["node"] == plan.nodes[1].node
    assert "kv_cache_tokens=" in by_marker["kv_cache_size"]["figures"]
    assert float(by_marker["endpoint_ready"]["seconds"]) == result.ready_after_s
    smoke_rows = artifact_rows(artifact_key("smoke-test", plan.deployment_id))
    check_rows = [row for row in smoke_rows if row["result"] != "info"]
    assert [row["check"] for row in check_rows] == [check.name for check in report.checks]
    assert {row["result"] for row in check_rows} == {"pass"}
    engine_rows = [row["check"] for row in smoke_rows if row["result"] == "info"]
    assert "engine /metrics: prompt_tokens" in engine_rows


def test_a_failed_boot_still_has_its_timeline_and_is_not_retried(
    lab_cluster: Lab, tmp_path: Path, deployments: list[Deployment]
) -> None:
    plan = deploy(lab_cluster, tmp_path, deployments, nodes=2, fault="fatal:dist_network@1")
    state = gate_then_smoke(plan, return_state=True)
    assert state.is_failed()
    with pytest.raises(BootFailed) as caught:
        state.result()
    worker = plan.nodes[1].node
    assert (caught.value.node, caught.value.kind) == (worker, "distributed_connect_timeout")
    timeline = artifact_rows(artifact_key("readiness-gate", plan.deployment_id))
    assert timeline[-1]["marker"] == "FAILED: distributed_connect_timeout"
    assert timeline[-1]["node"] == worker
    assert "trying to connect to" in timeline[-1]["line"]
    assert readiness_gate.retries == 0


def test_a_bad_engine_fails_the_smoke_test_with_its_table(
    lab_cluster: Lab, tmp_path: Path, deployments: list[Deployment]
) -> None:
    plan = deploy(lab_cluster, tmp_path, deployments, nodes=1, fault="token_loop")
    with pytest.raises(SmokeFailed, match="no_token_loops"):
        gate_then_smoke(plan)
    rows = {
        row["check"]: row for row in artifact_rows(artifact_key("smoke-test", plan.deployment_id))
    }
    assert rows["no_token_loops"]["result"] == "FAIL"
    assert "token loop" in rows["no_token_loops"]["evidence"]
