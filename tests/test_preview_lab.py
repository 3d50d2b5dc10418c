"""A preview on the lab, then the deploy it previews, compared step by step and byte for byte
(issue 22, item 6): a fresh lab's `lab-single` previews as a download (or a complete NAS), an
image pull (or present) and a free node, and its deploy fetches exactly those bytes, pulls
where the preview said and takes the node; a second preview says everything is in place and
the node held by this deployment (a redeploy), and the second deploy matches it, replacing its
own stale container."""

from __future__ import annotations

import json
from pathlib import Path
from uuid import UUID

import pytest
from lab_flows import nothing_runs

from flows.deploy import deploy
from flows.preview import preview as preview_flow
from flows.teardown import teardown
from sparkdeploy.model.cluster import load_cluster
from sparkdeploy.model.project import load_plan
from sparkdeploy.remote.docker_cli import list_containers
from sparkdeploy.remote.ssh import cached_connection
from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.steps.hold_nodes import holders
from sparkdeploy.steps.preview import Preview

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]

RECIPE = "lab-single"
# A preview's words for what the image step then reports (sparkdeploy.steps.image.NodeImage).
IMAGE_DONE = {"none": "present", "pull": "pulled", "build": "built", "ship": "distributed"}
# ...and for what stage-engram then reports (sparkdeploy.node.stage_engram.StagingResult).
ENGRAM_DONE = {"none": "skipped", "adopt": "adopted", "copy": "copied", "resume": "resumed"}


def _artifact_rows(flow_run_id: UUID, key: str) -> list[dict[str, object]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
            )
        )
    if not found:
        return []
    data = found[0].data
    rows = json.loads(data) if isinstance(data, str) else data
    assert isinstance(rows, list), rows
    return rows


def _containers(cluster: str) -> dict[str, str]:
    """Container name -> id of our containers on the plan's nodes."""
    plan = load_plan(RECIPE, cluster)
    found = {}
    for node, target in plan_targets(plan).items():
        for container in list_containers(cached_connection(target), node, "sparkdeploy.deployment"):
            found[container.name] = container.id
    return found


def _deploy_matches(found: Preview, cluster: str) -> None:
    """Deploy, and compare what it did with what the preview said, step by step."""
    plan = load_plan(RECIPE, cluster)
    before = _containers(cluster)
    state = deploy(RECIPE, cluster=cluster, return_state=True)
    assert state.is_completed(), state
    run_id = state.state_details.flow_run_id
    assert run_id is not None

    fetched: dict[str, int] = {}
    for file in _artifact_rows(run_id, "prefetch-files"):
        repo = str(file["repo"])
        fetched[repo] = fetched.get(repo, 0) + (
            int(str(file["bytes"])) if file["status"] == "fetched" else 0
        )
    for row in found.of_step("prefetch"):
        repo = row.subject.split("@", 1)[0]
        said = row.bytes if row.action == "download" else 0
        assert fetched[repo] == said, (row, fetched)

    image = {
        str(r["node"]): r["action"] for r in _artifact_rows(run_id, f"image-{plan.deployment_id}")
    }
    assert image == {row.node: IMAGE_DONE[row.action] for row in found.of_step("image")}

    staged = _artifact_rows(run_id, f"stage-engram-{plan.deployment_id}")
    assert {(str(r["node"]), str(r["file"])): r["status"] for r in staged} == {
        (row.node, row.subject): ENGRAM_DONE[row.action] for row in found.of_step("stage-engram")
    }

    held = holders(plan.cluster, [node.node for node in plan.nodes])
    for lock in found.of_step("hold-nodes"):
        assert lock.action in ("take", "take over"), lock
        holder = held[lock.node]
        assert holder is not None and holder.deployment_id == plan.deployment_id
        assert holder.flow_run_id == str(run_id)

    after = _containers(cluster)
    removed = {row.subject for row in found.of_step("boot") if row.action == "remove"}
    assert removed == set(before)  # the preview named every container boot replaced
    for name in removed:
        assert after.get(name) not in (None, before[name]), name  # started anew
    assert set(after) == {node.container.name for node in plan.nodes}


def test_a_deploy_does_what_its_preview_said_then_a_redeploy_too(cluster: str) -> None:
    plan = load_plan(RECIPE, cluster)
    node = plan.nodes[0].node
    inventory = load_cluster(Path(cluster))
    try:
        first = preview_flow(RECIPE, cluster=cluster)
        assert first.refusals == [], first.markdown()
        [repo] = first.of_step("prefetch")
        assert repo.action in ("download", "none") and repo.subject.startswith("lab/tiny-chat@")
        if repo.action == "download":
            assert repo.bytes and repo.expected_s and "(default)" in repo.timing
        [hold] = first.of_step("hold-nodes")
        assert (hold.node, hold.action, hold.detail) == (node, "take", "free")
        [image] = first.of_step("image")
        assert image.action in ("pull", "none"), image
        assert [row.action for row in first.of_step("boot")] in (["none"], [])
        assert set(holders(inventory.name, [node]).values()) == {None}  # the preview took none
        _deploy_matches(first, cluster)

        second = preview_flow(RECIPE, cluster=cluster)
        assert [r.action for r in second.of_step("prefetch")] == ["none"]
        assert "complete" in second.of_step("prefetch")[0].detail
        [hold] = second.of_step("hold-nodes")
        assert hold.action == "take over" and "held by this deployment" in hold.detail
        assert "redeploy" in hold.detail
        [image] = second.of_step("image")
        assert image.action == "none" and image.detail.startswith("present (sha256:")
        [boot] = second.of_step("boot")
        assert (boot.subject, boot.action) == (plan.nodes[0].container.name, "remove")
        assert "stale copy of this deployment" in boot.detail
        _deploy_matches(second, cluster)
    finally:
        teardown(RECIPE, cluster=cluster)
    nothing_runs(cluster)
