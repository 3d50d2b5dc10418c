"""Real vLLM (PyPI's CPU build, 0.32.0) deployed on the lab through the same pipeline.

The two-node recipe goes through a Prefect worker and `prefect deployment run`, answers the
smoke test's canaries, and a worker killed after ready is caught by the watchdog and named.
The one-node recipe passes its quality gate, which fails what the engine samples at a
temperature that flattens the model's choices. The start-up failures real vLLM has are each
seen on a real boot: named, quoted, nothing left.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from lab_flows import artifact_rows, ask, harness_env, lab_worker, nothing_runs, recipe_variant

from flows.deploy import Step, deploy
from flows.smoke import smoke
from flows.teardown import teardown
from lab.cluster import Lab
from lab.prefect_local import PROJECT_ROOT, deploy_run
from lab.vllm_runtime import RealEngine
from sparkdeploy.errors import BootFailed, FitError, SparkDeployError
from sparkdeploy.remote.ssh import cached_connection, close_cached
from sparkdeploy.remote.targets import node_target
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import load_plan
from sparkdeploy.steps.quality.builtin import typo_rate_eval
from sparkdeploy.steps.smoke_test import CANARIES, SmokeSettings
from sparkdeploy.steps.status import cluster_status

pytestmark = [pytest.mark.lab, pytest.mark.real_engine, pytest.mark.usefixtures("prefect_harness")]

REAL_1X = PROJECT_ROOT / "recipes" / "real-lab-1x" / "recipe.toml"
REAL_2X = PROJECT_ROOT / "recipes" / "real-lab-2x" / "recipe.toml"


@pytest.fixture(scope="module")
def cluster(lab_cluster: Lab, real_engine: RealEngine) -> Iterator[str]:
    yield str(lab_cluster.inventory_path)
    close_cached()


def docker_on(cluster: str, node: str, *argv: str) -> str:
    plan_node = next(n for n in load_plan("real-lab-2x", cluster).nodes if n.node == node)
    result = cached_connection(node_target(plan_node)).run(["docker", *argv], timeout=60)
    return result.stdout.decode()


def test_two_nodes_deploy_through_prefect_and_a_killed_worker_is_named(
    cluster: str, prefect_harness: Path, tmp_path: Path
) -> None:
    env = harness_env(prefect_harness)
    with lab_worker(env, tmp_path / "worker.log", tail_chars=8000):
        deploy_run(env, "real-lab-2x", cluster, watch_timeout_s=900)
    plan = load_plan("real-lab-2x", cluster)
    for canary in CANARIES:
        answer = ask(
            plan.endpoint, plan.served_model_name, canary.prompt, timeout_s=120, temperature=0
        )
        assert canary.is_answer(answer)
    [running] = cluster_status(load_cluster(Path(cluster)))
    assert running.recipe == "real-lab-2x"
    assert running.healthy
    assert running.nodes == ["node1", "node2"]

    # Real vLLM's head does not notice a dead worker: /health stays 200. The watchdog's real
    # requests find it, and the head's log and the worker's exit name the node.
    docker_on(cluster, "node2", "kill", plan.nodes[1].container.name)
    with pytest.raises(SparkDeployError) as caught:
        smoke(cluster=cluster)
    message = str(caught.value)
    assert "node2" in message, message

    teardown("real-lab-2x", cluster=cluster)
    runs = load_cluster(Path(cluster)).nas.runs_dir
    kept = sorted(Path(runs, plan.deployment_id).rglob("*.log"))
    assert [log.name for log in kept if "node1" in log.name], kept
    nothing_runs(cluster)


def test_the_quality_gate_passes_and_the_fit_check_estimates_the_kv_cache_real_vllm_makes(
    cluster: str,
) -> None:
    """One deployment for both (the smoke test skipped: the other tests run it)."""
    state = deploy("real-lab-1x", cluster=cluster, skip=["smoke-test"], return_state=True)
    summary = state.result()
    try:
        rows = {
            str(row["eval"]): row
            for row in artifact_rows(
                str(state.state_details.flow_run_id), f"quality-{summary.deployment_id}"
            )
        }
        print("\n".join(str(row) for row in rows.values()))
        assert list(rows) == ["typo_rate", "exact_answers"]
        assert all(row["result"] == "pass" for row in rows.values())
        assert rows["typo_rate"]["score"] == "0.00 %"
        assert str(rows["typo_rate"]["evidence"]).startswith("0 of ")
        assert rows["exact_answers"]["score"] == "100.0 %"
        # At temperature 2, the API's highest, what vLLM samples strays from the model's memorised
        # answers within a few words: the same typo eval fails it (18 to 30 % of the words, seen).
        plan = load_plan("real-lab-1x", cluster)
        assert plan.quality is not None
        assert plan.quality.typo_rate is not None
        flattened = plan.quality.typo_rate.model_copy(update={"temperature": 2.0})
        degraded = typo_rate_eval(SmokeSettings.for_plan(plan), flattened)
        print(degraded.verdict())
        assert degraded.score is not None, degraded.error
        assert not degraded.passed
    finally:
        teardown("real-lab-1x", cluster=cluster)
    runs = Path(load_cluster(Path(cluster)).nas.runs_dir, summary.deployment_id)
    head_log = max(runs.glob("node1*.log"), key=lambda path: path.stat().st_mtime).read_text()
    logged = re.search(r"CPU KV cache size: ([\d,]+) tokens", head_log)
    assert logged, head_log[-3000:]
    assert summary.fit is not None
    [node] = summary.fit.nodes
    assert node.kv_tokens == int(logged.group(1).replace(",", ""))
    assert node.verdict == "fits"
    nothing_runs(cluster)


@pytest.mark.parametrize(
    ("name", "replacement", "kind", "evidence"),
    [
        (
            "unknown-flag",
            ('"--max-num-seqs", "8",', '"--max-num-seqs", "8", "--bogus-flag", "1",'),
            "unrecognized_arguments",
            "unrecognized arguments: --bogus-flag 1",
        ),
        (
            "max-len-too-long",
            ('"--max-model-len", "2048"', '"--max-model-len", "4096"'),
            "max_model_len_too_long",
            "User-specified max_model_len (4096) is greater than the derived max_model_len",
        ),
        (
            "model-not-in-cache",
            ('model = "lab/tiny-llama-chat"', 'model = "lab/not-in-the-cache"'),
            "model_not_in_offline_cache",
            "LocalEntryNotFoundError",
        ),
    ],
)
def test_a_real_start_up_failure_is_named_and_leaves_nothing(
    cluster: str, tmp_path: Path, name: str, replacement: tuple[str, str], kind: str, evidence: str
) -> None:
    recipe = recipe_variant(tmp_path, f"real-{name}", REAL_1X, replacement)
    skip: list[Step] = ["prefetch", "smoke-test"]
    if kind == "model_not_in_offline_cache":
        # The fit step reads the model's files from the NAS first and refuses before any
        # boot; skipping it shows what the real engine says when it is started anyway.
        with pytest.raises(FitError, match="run the prefetch step"):
            deploy(recipe, cluster=cluster, skip=skip)
        nothing_runs(cluster)
        skip.append("fit")
    with pytest.raises(BootFailed) as failed:
        deploy(recipe, cluster=cluster, skip=skip)
    assert failed.value.kind == kind, failed.value
    assert failed.value.node == "node1"
    assert any(evidence in line for line in failed.value.excerpt), failed.value.excerpt
    nothing_runs(cluster)


def test_a_worker_that_never_joins_is_named(cluster: str, lab_cluster: Lab, tmp_path: Path) -> None:
    """node2 cannot reach node1 over the fabric (a blackhole route in node2's namespace): its
    worker never joins, and whichever ends the boot (the gate's timeout or the head's own)
    names node2."""
    recipe = recipe_variant(
        tmp_path,
        "real-partitioned",
        REAL_2X,
        ("[env]\n", '[env]\nVLLM_ENGINE_READY_TIMEOUT_S = "90"\n'),
    )
    route = ["blackhole", f"{lab_cluster.layout.node_ip('node1')}/32"]
    in_node2 = ["ip", "netns", "exec", lab_cluster.layout.node_netns("node2"), "ip", "route"]
    subprocess.run([*in_node2, "add", *route], check=True, timeout=10)
    try:
        with pytest.raises(BootFailed) as failed:
            deploy(recipe, cluster=cluster, skip=["smoke-test"])
    finally:
        subprocess.run([*in_node2, "del", *route], check=True, timeout=10)
    assert "node2" in str(failed.value), failed.value
    assert failed.value.kind == "worker_never_joined", failed.value
    nothing_runs(cluster)
