"""A deployment whose recipe changed, broke or vanished is still torn down (issue 23.4): by what
is on the nodes and in the node lock records, not by what the recipe file plans now. The
teardown flow, the status that lists such orphans, and the deploy's cancel/crash hook."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from lab_flows import (
    LAB_SINGLE_RECIPE,
    Worker,
    flow_process,
    nothing_runs,
    recipe_variant,
    wait_for_state,
    with_env,
)

from flows.deploy import deploy
from flows.teardown import teardown
from lab.testing.waiting import wait_for
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import ROOT_ENV, load_plan
from sparkdeploy.steps.status import cluster_status, teardown_command

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness", "clean_lab_after")]


def run_logs(flow_run_id: object) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [log.message for log in logs]


def test_a_deployment_whose_recipe_changed_broke_or_vanished_is_listed_and_torn_down(
    cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lab-single under a name of its own (recipes/lab-orphan of a project root of the test's),
    deployed; then its recipe changed (required_nodes 2: it plans another deployment id),
    broken (not TOML) or deleted. Status lists the deployment as an orphan with the teardown
    that removes it; the teardown (of the recipe, or by the deployment id status names)
    removes its container and frees its node, and says why it went by the deployment id."""
    root = tmp_path / "root"
    monkeypatch.setenv(ROOT_ENV, str(root))
    recipe_file = root / "recipes" / "lab-orphan" / "recipe.toml"
    inventory = load_cluster(Path(cluster))
    changes: dict[str, Callable[[str], str] | None] = {
        "changed": lambda text: text.replace("required_nodes = 1", "required_nodes = 2").replace(
            "tensor_parallel_size = 1", "tensor_parallel_size = 2"
        ),
        "broken": lambda text: text + "\n[[not toml\n",
        "vanished": None,
    }
    for case, change in changes.items():
        recipe_file.parent.mkdir(parents=True, exist_ok=True)
        recipe_file.write_text(LAB_SINGLE_RECIPE.read_text())
        deployed = load_plan("lab-orphan", cluster).deployment_id
        deployed_state = deploy(
            "lab-orphan", cluster=cluster, skip=["smoke-test"], return_state=True
        )
        assert deployed_state.is_completed(), (case, deployed_state.message)
        [serving] = cluster_status(inventory)
        assert serving.plan is not None, case
        assert serving.teardown_command is None, case
        if change is None:
            shutil.rmtree(recipe_file.parent)
        else:
            recipe_file.write_text(change(recipe_file.read_text()))

        [orphan] = cluster_status(inventory)
        assert (orphan.deployment_id, orphan.plan) == (deployed, None), case
        assert orphan.teardown_command == teardown_command(inventory.name, deployed)
        assert orphan.teardown_command in orphan.health_text, case

        # The broken one as status says to, by its id; the others by their recipe.
        by_id = case == "broken"
        torn = (
            teardown(cluster=cluster, deployment_id=deployed, return_state=True)
            if by_id
            else teardown("lab-orphan", cluster=cluster, return_state=True)
        )
        assert torn.is_completed(), (case, torn.message)
        [report] = torn.result()
        assert report.deployment_id == deployed, case
        assert [container.node for container in report.removed] == ["node1"], case
        said = run_logs(torn.state_details.flow_run_id)
        assert any(f"released node1 of cluster {inventory.name}" in line for line in said), said
        if not by_id:
            why = "now plans deployment" if case == "changed" else "cannot be planned"
            assert any(
                why in line and "by deployment id" in line and deployed in line for line in said
            ), (case, said)
        nothing_runs(cluster)

    # Nothing left of the vanished recipe: its teardown again is a no-op that says so.
    again = teardown("lab-orphan", cluster=cluster, return_state=True)
    assert again.is_completed(), again.message
    assert again.result() == [], again.message
    assert any("nothing to tear down" in line for line in run_logs(again.state_details.flow_run_id))


def test_a_deploy_killed_after_its_recipe_vanished_is_torn_down_by_its_lock_records(
    cluster: str, tmp_path: Path, worker: Worker
) -> None:
    """A deploy through a worker, its recipe deleted while its engine boots, then its process
    killed: the on_crashed hook cannot plan the recipe, and tears down by the lock records of
    its own run instead (it used to raise, leaving the container up and the node held)."""
    recipe = recipe_variant(
        tmp_path, "lab-vanishing", LAB_SINGLE_RECIPE, with_env(STANDIN_FAULT="slow_boot:20")
    )
    deployed = load_plan(recipe, cluster).deployment_id
    inventory = load_cluster(Path(cluster))
    try:
        flow_run_id = worker.submit(recipe, cluster)
        wait_for("boot of the deploy", lambda: cluster_status(inventory), timeout_s=300, poll_s=0.5)
        shutil.rmtree(recipe)
        process = wait_for(
            "process running the deploy",
            lambda: flow_process(worker.running().pid, flow_run_id),
            timeout_s=300,
            poll_s=0.2,
        )
        os.kill(process, signal.SIGKILL)
        assert wait_for_state(flow_run_id).is_crashed()
        wait_for(
            "log line 'crashed: tore down'",
            lambda: any(line.startswith("crashed: tore down") for line in run_logs(flow_run_id)),
            timeout_s=60,
            poll_s=0.5,
        )
    except BaseException:
        print(worker.log.read_text()[-5000:])
        raise
    said = run_logs(flow_run_id)
    assert any("cannot be planned" in line and "lock records" in line for line in said), said
    [tore] = [line for line in said if line.startswith("crashed: tore down")]
    assert deployed in tore, tore
    assert "on node1" in tore, tore
    assert "released node1" in tore, tore
    nothing_runs(cluster)
