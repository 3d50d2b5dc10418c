"""A first deploy onto a cluster that already runs (lab/brownfield.py): the old launcher's
hand-made Engram copies, hardlinked by another lane, an `hf download` NAS cache and an image
built on the nodes under a :local tag are adopted as they are. Through `prefect deployment run`
and a worker, the `preview` deployment first says so (the NAS cache adopted after hashing it,
every Engram copy adopted, the image present on every node, the container that is not ours
named, the nodes free), then the deploy fetches no byte from the hub, copies no Engram byte,
pulls and builds no image, leaves the other lane's links on the same inodes, names the
container that is not ours, serves, and did step by step what the preview said (issue 22)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lab_flows import (
    artifact_rows,
    ask,
    deploy_matches_preview,
    final_run_logs,
    harness_env,
    lab_worker,
    nothing_runs,
    our_containers,
    run_artifacts,
    wait_for_state,
)

from flows.teardown import teardown
from lab.brownfield import (
    BROWNFIELD_RECIPE,
    Brownfield,
    clear_brownfield,
    make_brownfield,
)
from lab.cluster import Lab
from lab.hub.control import HubControl
from lab.prefect_local import FLOW_RUN_ID, deploy_run, run_prefect
from sparkdeploy.report.history import artifact_key
from sparkdeploy.spec.plan import Plan
from sparkdeploy.spec.project import load_plan
from sparkdeploy.steps.preview import Preview

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]

RECIPE = str(BROWNFIELD_RECIPE)
# The preview's flow run keeps its result (a Preview) in the result storage under the
# session's PREFECT_HOME, which this process shares with the worker: Prefect persists none by
# default.
KEEP_RESULT = {"env": {"PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true"}}


def _preview_run(env: dict[str, str], cluster: str) -> tuple[str, Preview]:
    """preview/preview through `prefect deployment run` and the worker, as from the UI: its
    flow run's id and the Preview it returned."""
    started = run_prefect(
        env,
        "deployment",
        "run",
        "preview/preview",
        "--params",
        json.dumps({"recipe": RECIPE, "cluster": cluster}),
        *(
            arg
            for key, value in KEEP_RESULT.items()
            for arg in ("--job-variable", f"{key}={json.dumps(value)}")
        ),
    )
    named = FLOW_RUN_ID.search(started.stdout)
    assert named is not None, started.stdout
    run_id = named.group(1)
    state = wait_for_state(run_id, timeout_s=300)
    assert state.is_completed(), "\n".join(final_run_logs(run_id)[-40:])
    found = state.result()
    assert isinstance(found, Preview), found
    return run_id, found


def _preview_markdown(flow_run_id: str, plan: Plan) -> str:
    """The `preview-<deployment id>` markdown artifact the preview's flow run published."""
    [artifact] = run_artifacts(flow_run_id, any_=[artifact_key("preview", plan.deployment_id)])
    assert artifact.type == "markdown", artifact
    assert isinstance(artifact.data, str), artifact
    return artifact.data


def _previews_adoption(found: Preview, field: Brownfield, plan: Plan) -> None:
    """What the preview of a first deploy on the brownfield lab must say: every byte there is
    adopted, nothing is fetched, copied, pulled or built, the nodes are free and the container
    that is not ours is left alone."""
    assert found.refusals == [], found.markdown()
    nodes = [node.node for node in plan.nodes]
    [repo] = found.of_step("prefetch")
    assert repo.action == "adopt", repo
    assert repo.subject.startswith(f"{field.nas_repos[0]}@"), repo
    assert repo.bytes
    assert "adopt: hash " in repo.detail
    assert f"({repo.bytes} B)" in repo.detail
    assert "download" not in repo.detail, repo

    assert [(r.node, r.action, r.detail) for r in found.of_step("hold-nodes")] == [
        (node, "take", "free") for node in nodes
    ]

    engram = found.of_step("stage-engram")
    assert {(r.node, r.subject) for r in engram} == {(c.node, c.dest) for c in field.copies}
    assert {r.action for r in engram} == {"adopt"}, engram
    assert all(r.bytes and r.expected_s for r in engram), engram

    images = found.of_step("image")
    assert [r.node for r in images] == nodes
    assert {(r.action, r.bytes, r.detail) for r in images} == {
        ("none", 0, f"present ({field.image_id})")
    }, images

    assert {r.action for r in found.of_step("boot")} == {"none"}
    [foreign] = [r for r in found.of_step("boot") if r.subject == field.foreign_container]
    assert foreign.node == field.foreign_node, foreign
    assert "not ours" in foreign.detail, foreign
    assert "left alone" in foreign.detail


def test_a_first_deploy_on_a_brownfield_lab_adopts_what_is_there_and_moves_no_byte(
    cluster: str, lab_cluster: Lab, prefect_harness: Path, tmp_path: Path
) -> None:
    field = make_brownfield(lab_cluster, RECIPE, cluster=cluster)
    plan = load_plan(RECIPE, cluster)
    hub = HubControl(lab_cluster.hub_url)
    hub.reset_stats()
    env = harness_env(prefect_harness)
    try:
        with lab_worker(env, tmp_path / "worker.log"):
            preview_id, found = _preview_run(env, cluster)
            markdown = _preview_markdown(preview_id, plan)
            print(f"\n--- the preview's artifact, before the deploy ---\n{markdown}")
            assert markdown == found.markdown()
            _previews_adoption(found, field, plan)
            before = our_containers(plan)
            run_id = deploy_run(env, RECIPE, cluster)
            state = wait_for_state(run_id, timeout_s=600)
            logs = final_run_logs(run_id)
        assert state.is_completed(), "\n".join(logs[-40:])

        assert hub.stats()["bytes_served"] == 0, hub.requests()  # neither preview nor deploy
        [repo] = found.of_step("prefetch")
        hashed = [line for line in logs if f"{field.nas_repos[0]}: hashed " in line]
        assert hashed, "the hf download cache was not verified"
        assert any(f"({repo.bytes} bytes)" in line for line in hashed), (repo, hashed)

        stages = artifact_rows(run_id, f"stage-engram-{plan.deployment_id}")
        assert {row["status"] for row in stages} == {"adopted"}, stages
        for copy in field.copies:
            target = lab_cluster.node_path(copy.node, copy.dest)
            lane = lab_cluster.node_path(copy.node, copy.lane_link)
            assert target.stat().st_ino == copy.inode == lane.stat().st_ino, copy
            assert target.stat().st_nlink >= 2
            assert Path(f"{target}.manifest.json").is_file()

        images = artifact_rows(run_id, f"image-{plan.deployment_id}")
        assert {row["action"] for row in images} == {"present"}, images
        assert any(field.foreign_container in line for line in logs), "foreign container unnamed"

        deploy_matches_preview(found, plan, run_id, before)
        ask(plan.endpoint, plan.served_model_name, "Say OK.")
    finally:
        teardown(RECIPE, cluster=cluster)
        clear_brownfield(lab_cluster, field)
    nothing_runs(cluster)
