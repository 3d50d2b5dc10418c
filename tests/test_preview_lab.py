"""A preview on the lab, then the deploy it previews, compared step by step and byte for byte
(issue 22, item 6): a fresh lab's `lab-single` previews as a download (or a complete NAS), an
image pull (or present) and a free node, and its deploy fetches exactly those bytes, pulls
where the preview said and takes the node; a second preview says everything is in place and
the node held by this deployment (a redeploy), and the second deploy matches it, replacing its
own stale container."""

from __future__ import annotations

from pathlib import Path

import pytest
from lab_flows import deploy_matches_preview, nothing_runs, our_containers

from flows.deploy import deploy
from flows.preview import preview as preview_flow
from flows.teardown import teardown
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import load_plan
from sparkdeploy.steps.hold_nodes import holders
from sparkdeploy.steps.preview import Preview

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]

RECIPE = "lab-single"


def _deploy_matches(found: Preview, cluster: str) -> None:
    """Deploy, and compare what it did with what the preview said, step by step."""
    plan = load_plan(RECIPE, cluster)
    before = our_containers(plan)
    state = deploy(RECIPE, cluster=cluster, return_state=True)
    assert state.is_completed(), state
    run_id = state.state_details.flow_run_id
    assert run_id is not None
    deploy_matches_preview(found, plan, run_id, before)


def test_a_deploy_does_what_its_preview_said_then_a_redeploy_too(cluster: str) -> None:
    plan = load_plan(RECIPE, cluster)
    node = plan.nodes[0].node
    inventory = load_cluster(Path(cluster))
    try:
        first = preview_flow(RECIPE, cluster=cluster)
        assert first.refusals == [], first.markdown()
        [repo] = first.of_step("prefetch")
        assert repo.action in ("download", "none")
        assert repo.subject.startswith("lab/tiny-chat@")
        if repo.action == "download":
            assert repo.bytes
            assert repo.expected_s
            assert "(default)" in repo.timing
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
        assert hold.action == "take over"
        assert "held by this deployment" in hold.detail
        assert "redeploy" in hold.detail
        [image] = second.of_step("image")
        assert image.action == "none"
        assert image.detail.startswith("present (sha256:")
        [boot] = second.of_step("boot")
        assert (boot.subject, boot.action) == (plan.nodes[0].container.name, "remove")
        assert "stale copy of this deployment" in boot.detail
        _deploy_matches(second, cluster)
    finally:
        teardown(RECIPE, cluster=cluster)
    nothing_runs(cluster)
