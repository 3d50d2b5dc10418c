"""An unpinned repo whose branch moves on the hub after it was deployed (issue 22): `lab-single`
takes lab/tiny-chat at `main`. Once it is deployed, the lab hub's `main` of that repo moves (a
file added there), and:
- a preview says the branch moved, from which commit to which, and how many bytes
  update_revisions=true would take;
- an ensure run keeps the commit the NAS's refs/main names and asks the hub nothing;
- a repair of the killed deployment redeploys it on that same commit, again without asking the
  hub: a repair at 2 a.m. never pulls weights the branch moved to since;
- a deploy with update_revisions=true moves to the new commit, fetching only the added file
  from the hub, and does what its preview said.
The hub's repo and the NAS's refs/main are put back at the end."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import HfApi
from lab_flows import answers_the_canary, deploy_matches_preview, nothing_runs, our_containers

from flows.deploy import deploy
from flows.prefetch_all import prefetch_all
from flows.preview import preview as preview_flow
from flows.teardown import teardown
from lab.cluster import Lab
from lab.hub.control import HubControl
from lab.models import TINY_CHAT, publish_lab_models
from sparkdeploy.node.hfcache import resolve_snapshot
from sparkdeploy.remote.ssh import cached_connection
from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.spec.project import load_plan
from sparkdeploy.units import human_bytes

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]

RECIPE = "lab-single"
REPO = TINY_CHAT.repo_id
# The file that moves the hub's main: a top-level *.txt, which the prefetch takes (an engine
# reads it: sparkdeploy.steps.prefetch.selection), so the new commit has bytes to fetch.
ADDED = "drift-notes.txt"
ADDED_BYTES = 3000


def _hub_main(lab: Lab) -> str:
    """The commit the lab hub's main of the repo names now."""
    sha = HfApi(endpoint=lab.hub_url, token=False).model_info(REPO, revision="main").sha
    assert sha is not None
    return sha


def _nas_main(nas: str) -> str:
    """The commit the NAS's refs/main of the repo names (what every deploy takes)."""
    sha, _ = resolve_snapshot(nas, REPO, None)
    return sha


def _snapshot_bytes(nas: str, sha: str) -> int:
    """The bytes of the files the NAS's snapshot of the repo at `sha` holds."""
    _, snapshot = resolve_snapshot(nas, REPO, sha)
    return sum(path.stat().st_size for path in Path(snapshot).rglob("*") if path.is_file())


def test_a_branch_that_moved_on_the_hub_is_shown_and_kept_until_update_revisions(
    cluster: str, lab_cluster: Lab
) -> None:
    plan = load_plan(RECIPE, cluster)
    nas = plan.nas_hf_cache
    hub = HubControl(lab_cluster.hub_url)
    added = lab_cluster.hub_repos_dir / REPO / ADDED
    [node] = plan.nodes
    try:
        deploy(RECIPE, cluster=cluster)
        deployed = _nas_main(nas)
        assert deployed == _hub_main(lab_cluster)

        added.write_bytes(b"the branch moved on\n".ljust(ADDED_BYTES, b"."))
        moved = _hub_main(lab_cluster)
        assert moved != deployed

        found = preview_flow(RECIPE, cluster=cluster)
        print(f"\n--- the preview after main moved ---\n{found.markdown()}")
        [repo] = found.of_step("prefetch")
        assert repo.action == "none", repo
        assert repo.subject == f"{REPO}@main ({deployed[:12]})", repo
        assert f"main at {deployed[:12]}, as the NAS holds it" in repo.detail
        # The new commit's snapshot is all missing, but only the added file's bytes are not in
        # the NAS's blobs already: they alone would come from the hub.
        more = _snapshot_bytes(nas, deployed) + ADDED_BYTES
        assert (
            f"main moved from {deployed[:12]} to {moved[:12]}: {human_bytes(more)} ({more} B)"
            f" more, {human_bytes(ADDED_BYTES)} ({ADDED_BYTES} B) of it from the hub"
            f" ({human_bytes(more - ADDED_BYTES)} in blobs another commit holds: linked)"
            " (deploy with update_revisions=true to take it)"
        ) in repo.detail, repo

        # An ensure run: the deployment runs from refs/main's commit, which has not moved.
        hub.reset_stats()
        running = our_containers(plan)
        ensured = deploy(RECIPE, cluster=cluster, ensure=True)
        assert ensured.note.startswith("Already serving: "), ensured
        assert "Nothing else was done" in ensured.note
        assert our_containers(plan) == running
        assert _nas_main(nas) == deployed
        assert hub.requests() == [], hub.requests()  # not even a listing

        # A repair of the deployment, killed: redeployed on the commit the NAS holds.
        cached_connection(plan_targets(plan)[node.node]).run(
            ["docker", "kill", node.container.name], timeout=60
        )
        repaired = deploy(RECIPE, cluster=cluster, repair_cause="test")
        assert repaired.note == "", repaired
        assert repaired.ready_after_s is not None, repaired
        assert our_containers(plan)[node.container.name] != running[node.container.name]
        assert _nas_main(nas) == deployed
        assert hub.requests() == [], hub.requests()
        assert hub.stats()["bytes_served"] == 0
        assert answers_the_canary(plan.endpoint)

        # update_revisions: the new commit, of which only the added file is fetched.
        taking = preview_flow(RECIPE, cluster=cluster, update_revisions=True)
        [repo] = taking.of_step("prefetch")
        assert repo.subject == f"{REPO}@main ({moved[:12]})", repo
        assert f"main moved from {deployed[:12]} to {moved[:12]}: the new commit is taken" in (
            repo.detail
        )
        hub.reset_stats()
        before = our_containers(plan)
        state = deploy(RECIPE, cluster=cluster, update_revisions=True, return_state=True)
        assert state.is_completed(), state
        assert state.state_details.flow_run_id is not None
        deploy_matches_preview(taking, plan, state.state_details.flow_run_id, before)
        assert _nas_main(nas) == moved
        assert hub.stats()["bytes_served"] == ADDED_BYTES, hub.requests()
        assert answers_the_canary(plan.endpoint)
    finally:
        teardown(RECIPE, cluster=cluster)
        added.unlink(missing_ok=True)
        publish_lab_models(lab_cluster.hub_repos_dir)
        # The NAS back at the hub's main, as the other tests expect it.
        prefetch_all(cluster=cluster, recipes=RECIPE, update_revisions=True)
    assert _hub_main(lab_cluster) == _nas_main(nas)
    nothing_runs(cluster)
