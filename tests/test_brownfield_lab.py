"""A first deploy onto a cluster that already runs (lab/brownfield.py): the old launcher's
hand-made Engram copies, hardlinked by another lane, an `hf download` NAS cache and an image
built on the nodes under a :local tag are adopted as they are. Through `prefect deployment run`
and a worker, the deploy fetches no byte from the hub, copies no Engram byte, pulls and builds
no image, leaves the other lane's links on the same inodes, names the container that is not
ours, and serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lab_flows import ask, harness_env, lab_worker, nothing_runs, wait_for_state

from flows.teardown import teardown
from lab.brownfield import BROWNFIELD_RECIPE, make_brownfield, remove_foreign_container
from lab.cluster import Lab
from lab.hub import HubControl
from lab.prefect_local import deploy_run
from sparkdeploy.model.project import load_plan

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]

RECIPE = str(BROWNFIELD_RECIPE)


def _run_logs(flow_run_id: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        filter_ = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        found, offset = [], 0
        while page := client.read_logs(filter_, limit=200, offset=offset):
            found += [log.message for log in page]
            offset += len(page)
    return found


def _artifact_rows(key: str) -> list[dict[str, object]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
        )
    latest = max(found, key=lambda artifact: artifact.created or 0)
    data = latest.data
    rows = json.loads(data) if isinstance(data, str) else data
    assert isinstance(rows, list), rows
    return rows


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
            run_id = deploy_run(env, RECIPE, cluster)
            state = wait_for_state(run_id, timeout_s=600)
        logs = _run_logs(run_id)
        assert state.is_completed(), "\n".join(logs[-40:])

        assert hub.stats()["bytes_served"] == 0, hub.requests()
        hashed = [line for line in logs if "hashed" in line]
        assert hashed, "the hf download cache was not verified"

        stages = _artifact_rows(f"stage-engram-{plan.deployment_id}")
        assert {row["status"] for row in stages} == {"adopted"}, stages
        for copy in field.copies:
            target = lab_cluster.node_path(copy.node, copy.dest)
            lane = lab_cluster.node_path(copy.node, copy.lane_link)
            assert target.stat().st_ino == copy.inode == lane.stat().st_ino, copy
            assert target.stat().st_nlink >= 2
            assert Path(f"{target}.manifest.json").is_file()

        images = _artifact_rows(f"image-{plan.deployment_id}")
        assert {row["action"] for row in images} == {"present"}, images
        assert any(field.foreign_container in line for line in logs), "foreign container unnamed"

        ask(plan.endpoint, plan.served_model_name, "Say OK.")
    finally:
        teardown(RECIPE, cluster=cluster)
        remove_foreign_container(lab_cluster, field.foreign_node)
    nothing_runs(cluster)
