"""The flows on the lab, against a Prefect server: a full deploy through a worker and
`prefect deployment run`, status and teardown, a blocked recipe refused, the nightly prefetch.
What a deploy does when something breaks is tests/test_fault_matrix.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from lab_flows import ask, harness_env, lab_worker, nothing_runs, recipe_variant

from flows.deploy import deploy
from flows.prefetch_all import prefetch_all
from lab.prefect_local import deploy_run, deployment_run
from sparkdeploy.errors import ImageError, RecipeBlocked
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import load_plan
from sparkdeploy.steps.status import cluster_status

ROOT = Path(__file__).parent.parent

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]


def test_full_deploy_through_a_worker_and_prefect_deployment_run(
    cluster: str, prefect_harness: Path, tmp_path: Path
) -> None:
    env = harness_env(prefect_harness)
    with lab_worker(env, tmp_path / "worker.log"):
        deploy_run(env, "lab-dsv41-3x", cluster, watch_timeout_s=600)
        deployment_run(env, "status/status", {"cluster": cluster}, watch_timeout_s=600)
        plan = load_plan("lab-dsv41-3x", cluster)
        assert "5461" in ask(plan.endpoint, plan.served_model_name, "What is 127*43?")
        [running] = cluster_status(load_cluster(Path(cluster)))
        assert running.recipe == "lab-dsv41-3x" and running.healthy
        assert running.nodes == ["node1", "node2", "node3"]
        deployment_run(
            env,
            "teardown/teardown",
            {"cluster": cluster, "recipe": "lab-dsv41-3x"},
            watch_timeout_s=300,
        )
    nothing_runs(cluster)


def test_blocked_recipe_is_refused_quoting_its_reason(cluster: str) -> None:
    with pytest.raises(RecipeBlocked, match="GLM MLA parent-page stride") as refused:
        deploy("glm53-flash-r27-dflash2", cluster=cluster)
    assert "allow_blocked" in str(refused.value)
    nothing_runs(cluster)


def test_an_image_neither_buildable_here_nor_on_the_nodes_is_refused_before_the_prefetch(
    cluster: str, tmp_path: Path
) -> None:
    recipe = recipe_variant(
        tmp_path,
        "hand-built",
        ROOT / "recipes" / "lab-single" / "recipe.toml",
        ('docker_image = "lab/vllm-standin:latest"', 'docker_image = "lab/hand-built:1"'),
        ('model = "lab/tiny-chat"', 'model = "lab/never-fetched"\ndocker_image_dir = "not-here"'),
    )
    # The model does not exist on the lab's hub: a prefetch that started would fail otherwise.
    with pytest.raises(ImageError, match="recipe hand-built: lab/hand-built:1") as refused:
        deploy(recipe, cluster=cluster)
    assert "missing on node1. Fix:" in str(refused.value)
    nothing_runs(cluster)


def test_prefetch_all_fetches_every_deployable_lab_recipe_once(cluster: str) -> None:
    outcomes = prefetch_all(cluster=cluster, recipes="lab-*")
    assert sorted(outcome.repo for outcome in outcomes) == ["lab/tiny-chat", "lab/tiny-dsv41"]
    assert all(
        outcome.fetched_bytes == 0 for outcome in prefetch_all(cluster=cluster, recipes="lab-*")
    )
