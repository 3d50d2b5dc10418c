"""Redeploy with rollback on the lab: a replacing deploy that fails its smoke test brings back
what it replaced, serving again; one that succeeds commits; and a replacing deploy whose flow
process is killed mid-way (so no rollback hook runs) is finished by the next run, which still
knows what to bring back."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from lab_flows import (
    LAB_SINGLE_RECIPE,
    answers_the_canary,
    flow_process,
    harness_env,
    lab_worker,
    nothing_runs,
    recipe_variant,
    task_history,
    wait_for_state,
    with_env,
)

from flows.deploy import deploy
from flows.teardown import teardown
from lab.prefect_local import deployment_run
from lab.testing.waiting import wait_for
from sparkdeploy.errors import NodeLockError, RolledBack
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import load_plan
from sparkdeploy.steps.hold_nodes import holders
from sparkdeploy.steps.status import cluster_status

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]


def only_running(cluster: str) -> str:
    """The one deployment on the lab's nodes (its health is the caller's to check: a recipe
    written for a test cannot be re-planned from its labels)."""
    [running] = cluster_status(load_cluster(Path(cluster)))
    return running.deployment_id


def test_a_failed_replacement_rolls_back_and_a_good_one_commits(
    cluster: str, tmp_path: Path
) -> None:
    serving = deploy("lab-single", cluster=cluster)
    inventory = load_cluster(Path(cluster))
    bad = recipe_variant(
        tmp_path, "lab-loop", LAB_SINGLE_RECIPE, with_env(STANDIN_FAULT="token_loop")
    )
    # Without replace, the lock refusal stands, and says how to replace.
    with pytest.raises(NodeLockError, match="deploy with replace=true"):
        deploy(bad, cluster=cluster, lock_timeout_s=2)
    with pytest.raises(RolledBack) as rolled:
        deploy(bad, cluster=cluster, replace=True)
    message = str(rolled.value)
    print(message)
    assert "no_token_loops" in message
    assert (
        f"rolled back to {serving.deployment_id} (lab-single on node1), which is serving again"
        f" at {serving.endpoint}"
    ) in message
    assert only_running(cluster) == serving.deployment_id
    assert answers_the_canary(serving.endpoint)
    holder = holders(inventory.name, ["node1"])["node1"]
    assert holder is not None
    assert holder.deployment_id == serving.deployment_id
    assert holder.replaces is None
    assert holder.flow_run_id is not None
    # The failed run's history: the new deployment's steps rolled back, the old one's rerun.
    history = task_history(holder.flow_run_id, settled=True)
    print("\n".join(history))
    bad_id = load_plan(bad, cluster).deployment_id
    assert f"boot {bad_id}: RolledBack" in history
    assert f"hold-nodes {bad_id}: RolledBack" in history
    assert f"smoke-test {bad_id}: Failed" in history
    assert f"boot {serving.deployment_id}: Completed" in history
    assert f"smoke-test {serving.deployment_id}: Completed" in history
    kept = Path(inventory.nas.runs_dir) / bad_id
    assert any(kept.glob("node1*.log")), "the failed deployment's log was not kept"

    good = recipe_variant(tmp_path, "lab-next", LAB_SINGLE_RECIPE)
    replaced_by = deploy(good, cluster=cluster, replace=True)
    assert only_running(cluster) == replaced_by.deployment_id
    assert answers_the_canary(replaced_by.endpoint)
    holder = holders(inventory.name, ["node1"])["node1"]
    assert holder is not None
    assert holder.deployment_id == replaced_by.deployment_id
    assert holder.replaces is None  # committed
    assert any((Path(inventory.nas.runs_dir) / serving.deployment_id).glob("node1*.log"))
    teardown(good, cluster=cluster)
    nothing_runs(cluster)


def test_a_replacement_killed_mid_way_is_finished_by_the_next_run(
    cluster: str, prefect_harness: Path, tmp_path: Path
) -> None:
    """The replacing deploy's flow process is SIGKILLed after it removed lab-single and started
    its own container: no rollback hook runs. The node's record still says which deployment it
    was replacing, so a deploy without replace refuses, naming both, and the next replacing
    deploy of the same recipe fails its smoke test and rolls back to lab-single."""
    env = harness_env(prefect_harness)
    serving = deploy("lab-single", cluster=cluster)
    inventory = load_cluster(Path(cluster))
    slow_bad = recipe_variant(
        tmp_path,
        "lab-slow-loop",
        LAB_SINGLE_RECIPE,
        with_env(STANDIN_FAULT="slow_boot:30,token_loop"),
    )
    slow_bad_id = load_plan(slow_bad, cluster).deployment_id
    with lab_worker(env, tmp_path / "worker.log") as worker:
        run_id = deployment_run(
            env,
            "deploy/deploy",
            {"recipe": slow_bad, "cluster": cluster, "replace": True},
        )
        wait_for(
            "boot of the replacement",
            lambda: [s.deployment_id for s in cluster_status(inventory)] == [slow_bad_id],
            timeout_s=300,
            poll_s=1,
        )
        pid = flow_process(worker.pid, run_id)
        assert pid is not None, "no flow process of the run under the worker"
        os.kill(pid, signal.SIGKILL)
        state = wait_for_state(run_id)
        print(f"the killed run ended {state.name}")
        assert state.is_crashed(), state
    holder = holders(inventory.name, ["node1"])["node1"]
    assert holder is not None
    assert holder.deployment_id == slow_bad_id
    assert holder.replaces is not None
    assert holder.replaces.deployment_id == serving.deployment_id

    # The next run, without replace: refused, naming what was being replaced.
    other = recipe_variant(tmp_path, "lab-other", LAB_SINGLE_RECIPE)
    with pytest.raises(NodeLockError, match=f"replacing deployment {serving.deployment_id}"):
        deploy(other, cluster=cluster, lock_timeout_s=2)
    # The next replacing run of the same recipe: its stale copy goes, it fails its smoke test
    # again, and lab-single (not the killed run's half-started containers) comes back.
    with pytest.raises(RolledBack, match=f"rolled back to {serving.deployment_id}"):
        deploy(slow_bad, cluster=cluster, replace=True)
    assert only_running(cluster) == serving.deployment_id
    assert answers_the_canary(serving.endpoint)
    teardown("lab-single", cluster=cluster)
    nothing_runs(cluster)
