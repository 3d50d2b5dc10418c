"""The flows on the lab, against a Prefect server: a full deploy through a worker and
`prefect deployment run`, named failures that leave nothing behind, node locks between
deployments, a blocked recipe refused, status and teardown."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lab_flows import nothing_runs, recipe_variant

from flows.deploy import deploy
from flows.prefetch_all import prefetch_all
from flows.smoke import smoke
from flows.status import status
from flows.teardown import teardown
from lab.cluster import Lab
from lab.models import publish_lab_models
from lab.prefect_local import PROJECT_ROOT, register_deployments, run_prefect, start_worker
from lab.prefect_local import stop_worker as stop_prefect_worker
from sparkdeploy.errors import BootFailed, NodeLockError, RecipeBlocked, SmokeFailed
from sparkdeploy.model.cluster import load_cluster
from sparkdeploy.model.project import load_plan
from sparkdeploy.remote import engine_http
from sparkdeploy.remote.ssh import cached_connection, close_cached
from sparkdeploy.remote.targets import node_target
from sparkdeploy.steps.hold_nodes import holders
from sparkdeploy.steps.status import cluster_status

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]

SINGLE = PROJECT_ROOT / "recipes" / "lab-single" / "recipe.toml"
DSV41 = PROJECT_ROOT / "recipes" / "lab-dsv41-3x" / "recipe.toml"


@pytest.fixture(scope="module")
def cluster(lab_cluster: Lab, lab_engine_image: str) -> Iterator[str]:
    """The lab's inventory (a path: the flows take names or paths), with the lab models."""
    publish_lab_models(lab_cluster.hub_repos_dir)
    yield str(lab_cluster.inventory_path)
    close_cached()


def with_fault(fault: str) -> tuple[str, str]:
    return "[env]\n", f'[env]\nSTANDIN_FAULT = "{fault}"\n'


def chat(endpoint: str, model: str, prompt: str) -> str:
    reply = engine_http.request(
        "POST",
        f"{endpoint}/v1/chat/completions",
        timeout=30,
        json_body={"model": model, "messages": [{"role": "user", "content": prompt}]},
    )
    assert reply.status == 200, reply.body
    return str(reply.json()["choices"][0]["message"]["content"])


def test_full_deploy_through_a_worker_and_prefect_deployment_run(
    cluster: str, prefect_harness: Path, tmp_path: Path
) -> None:
    from prefect.settings import PREFECT_API_URL

    env = {
        **os.environ,
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "PREFECT_HOME": str(prefect_harness),
    }
    register_deployments(env)
    worker = start_worker(env, tmp_path / "worker.log")
    try:
        for flow_name, recipe in (("deploy", "lab-dsv41-3x"), ("status", None)):
            params = ["-p", f"cluster={cluster}"]
            if recipe:
                params += ["-p", f"recipe={recipe}"]
            run_prefect(
                env,
                "deployment",
                "run",
                f"{flow_name}/{flow_name}",
                *params,
                "--watch",
                "--watch-timeout",
                "600",
                timeout=660,
            )
        plan = load_plan("lab-dsv41-3x", cluster)
        assert "5461" in chat(plan.endpoint, plan.served_model_name, "What is 127*43?")
        [running] = cluster_status(load_cluster(Path(cluster)))
        assert running.recipe == "lab-dsv41-3x" and running.healthy
        assert running.nodes == ["node1", "node2", "node3"]
        run_prefect(
            env,
            "deployment",
            "run",
            "teardown/teardown",
            "-p",
            f"cluster={cluster}",
            "-p",
            "recipe=lab-dsv41-3x",
            "--watch",
            timeout=300,
        )
    except subprocess.SubprocessError:
        print((tmp_path / "worker.log").read_text()[-5000:])
        raise
    finally:
        stop_prefect_worker(worker)
    nothing_runs(cluster)


def test_a_deploy_cancelled_with_prefect_flow_run_cancel_tears_down_and_lets_go(
    cluster: str, prefect_harness: Path, tmp_path: Path
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.settings import PREFECT_API_URL

    env = {
        **os.environ,
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "PREFECT_HOME": str(prefect_harness),
    }
    recipe = recipe_variant(tmp_path, "lab-slow", SINGLE, with_fault("slow_boot:30"))
    register_deployments(env)
    worker = start_worker(env, tmp_path / "worker.log")
    try:
        started = run_prefect(
            env,
            "deployment",
            "run",
            "deploy/deploy",
            "-p",
            f"recipe={recipe}",
            "-p",
            f"cluster={cluster}",
        )
        match = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout)
        assert match, started.stdout
        run_id = match.group(1)
        inventory = load_cluster(Path(cluster))
        deadline = time.monotonic() + 300
        while not cluster_status(inventory):
            assert time.monotonic() < deadline, "the deploy's boot never started"
            time.sleep(1)
        cancelled_at = time.monotonic()
        run_prefect(env, "flow-run", "cancel", run_id)
        with get_client(sync_client=True) as client:
            while (state := client.read_flow_run(run_id).state) is None or not state.is_final():
                assert time.monotonic() - cancelled_at < 90, f"still {state} 90 s after cancel"
                time.sleep(1)
            assert state.is_cancelled(), state
            print(f"cancelled after {time.monotonic() - cancelled_at:.1f} s")
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
        messages = [log.message for log in logs]
        assert any(
            message.startswith("cancelled: tore down") and "node1" in message
            for message in messages
        ), messages[-20:]
    except (subprocess.SubprocessError, AssertionError):
        print((tmp_path / "worker.log").read_text()[-5000:])
        raise
    finally:
        stop_prefect_worker(worker)
    nothing_runs(cluster)


def test_the_cancellation_hook_alone_tears_down_what_a_killed_run_left(cluster: str) -> None:
    """As when the worker SIGKILLs the flow's process at the end of its grace, before the
    flow's own failure path has torn anything down: the hook, run by the worker with the run's
    parameters only, removes the containers and lets the nodes go."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    from tasks.teardown import tear_down_cancelled_run

    summary = deploy("lab-single", cluster=cluster, skip=["smoke"])
    inventory = load_cluster(Path(cluster))
    holder = holders(inventory.name, ["node1"])["node1"]
    assert holder is not None and holder.flow_run_id is not None
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(holder.flow_run_id)
    tear_down_cancelled_run(deploy, flow_run, Cancelling())
    nothing_runs(cluster)
    # node1.log is this run's; an earlier run of the same deployment's moved aside as node1.<n>.log
    kept_log = Path(inventory.nas.runs_dir) / summary.deployment_id / "node1.log"
    assert kept_log.stat().st_size > 0


def test_blocked_recipe_is_refused_quoting_its_reason(cluster: str) -> None:
    with pytest.raises(RecipeBlocked, match="GLM MLA parent-page stride") as refused:
        deploy("glm53-flash-r27-dflash2", cluster=cluster)
    assert "allow_blocked" in str(refused.value)
    nothing_runs(cluster)


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        ("fatal:cuda_oom", "cuda_out_of_memory"),
        ("exit137", "killed"),
        ("crash", "engine_core_init_failed"),
        ("fatal:free_memory", "free_memory_below_utilization"),
    ],
)
def test_an_engine_fault_fails_the_deploy_by_name_and_leaves_nothing(
    cluster: str, tmp_path: Path, fault: str, kind: str
) -> None:
    recipe = recipe_variant(tmp_path, "lab-fault", SINGLE, with_fault(fault))
    with pytest.raises(BootFailed) as failed:
        deploy(recipe, cluster=cluster, skip=["smoke"])
    assert failed.value.kind == kind
    assert failed.value.node == "node1"
    nothing_runs(cluster)


def test_a_hang_fails_on_the_readiness_timeout(cluster: str, tmp_path: Path) -> None:
    recipe = recipe_variant(
        tmp_path,
        "lab-hang",
        SINGLE,
        with_fault("hang"),
        ('VLLM_ENGINE_READY_TIMEOUT_S = "60"', 'VLLM_ENGINE_READY_TIMEOUT_S = "5"'),
    )
    with pytest.raises(BootFailed) as failed:
        deploy(recipe, cluster=cluster)
    assert failed.value.kind == "timeout"
    nothing_runs(cluster)


def test_a_bad_engine_fails_the_smoke_test_and_is_rolled_back(cluster: str, tmp_path: Path) -> None:
    recipe = recipe_variant(tmp_path, "lab-loop", SINGLE, with_fault("token_loop"))
    with pytest.raises(SmokeFailed, match="no_token_loops"):
        deploy(recipe, cluster=cluster)
    nothing_runs(cluster)


def test_overlapping_deployments_never_both_run(cluster: str, tmp_path: Path) -> None:
    first = deploy("lab-single", cluster=cluster)
    try:
        two_nodes = recipe_variant(
            tmp_path,
            "lab-two",
            SINGLE,
            ("required_nodes = 1", "required_nodes = 2"),
            ("tensor_parallel_size = 1", "tensor_parallel_size = 2"),
        )
        with pytest.raises(
            NodeLockError, match=f"node1 is held by deployment {first.deployment_id}"
        ):
            deploy(two_nodes, cluster=cluster, lock_timeout_s=3)
        # The nodes are held before anything is put on them: a deployment that waits for a node
        # stages, composes and starts nothing, not even on the nodes no one holds.
        composing = recipe_variant(tmp_path, "lab-dsv41-wait", DSV41)
        with pytest.raises(NodeLockError, match=f"held by deployment {first.deployment_id}"):
            deploy(composing, cluster=cluster, lock_timeout_s=1)
        for node in load_plan(composing, cluster).nodes:
            assert node.composed is not None
            listed = cached_connection(node_target(node)).run(
                ["ls", "-d", node.composed.root], timeout=30, check=False
            )
            assert listed.exit_code != 0, f"{node.node} has {node.composed.root}"
        [running] = cluster_status(load_cluster(Path(cluster)))
        assert running.deployment_id == first.deployment_id and running.healthy
        assert status(cluster=cluster)[0].deployment_id == first.deployment_id
        [report] = smoke(cluster=cluster)
        assert report.passed and report.served_model_name == "tiny-chat"
    finally:
        teardown("lab-single", cluster=cluster)
    # Idempotent: a second teardown finds nothing and succeeds.
    assert teardown("lab-single", cluster=cluster).removed == []
    nothing_runs(cluster)


def test_prefetch_all_fetches_every_deployable_lab_recipe_once(cluster: str) -> None:
    outcomes = prefetch_all(cluster=cluster, recipes="lab-*")
    assert sorted(outcome.repo for outcome in outcomes) == ["lab/tiny-chat", "lab/tiny-dsv41"]
    assert all(
        outcome.fetched_bytes == 0 for outcome in prefetch_all(cluster=cluster, recipes="lab-*")
    )
