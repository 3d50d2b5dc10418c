"""The flows on the lab, against a Prefect server: a full deploy through a worker and
`prefect deployment run`, status (every column, on the CLI and in the flow's artifact) and
teardown, a blocked recipe refused, the nightly prefetch. What a deploy does when something
breaks is the fault matrix, tests/test_fault_matrix_*.py."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

import pytest
from lab_flows import ask, harness_env, lab_worker, nothing_runs, recipe_variant
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey
from typer.testing import CliRunner

from flows.deploy import deploy
from flows.prefetch_all import prefetch_all
from lab.prefect_local import deploy_run, deployment_run
from sparkdeploy.cli import app
from sparkdeploy.errors import ImageError, RecipeBlocked
from sparkdeploy.report.history import artifact_key
from sparkdeploy.spec.cluster import Cluster, load_cluster
from sparkdeploy.spec.plan import Plan
from sparkdeploy.spec.project import load_plan
from sparkdeploy.steps.sentinel import run_sentinel
from sparkdeploy.steps.status import cluster_status
from sparkdeploy.steps.status_view import COLUMNS, read_status
from tasks.sentinel import PrefectReporter, watched_plans

ROOT = Path(__file__).parent.parent

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]


def test_full_deploy_through_a_worker_and_prefect_deployment_run(
    cluster: str, prefect_harness: Path, tmp_path: Path
) -> None:
    env = harness_env(prefect_harness)
    with lab_worker(env, tmp_path / "worker.log"):
        deploy_run(env, "lab-dsv41-3x", cluster, watch_timeout_s=600)
        inventory = load_cluster(Path(cluster))
        # A few seconds of the sentinel: its record says when it last probed the deployment.
        reporter = PrefectReporter(cluster, inventory, logging.getLogger("sentinel-test"))
        run_sentinel(lambda: watched_plans(inventory), reporter, run_for_s=5)
        reporter.close()
        deployment_run(env, "status/status", {"cluster": cluster}, watch_timeout_s=600)
        plan = load_plan("lab-dsv41-3x", cluster)
        assert "5461" in ask(plan.endpoint, plan.served_model_name, "What is 127*43?")
        [running] = cluster_status(inventory)
        assert running.recipe == "lab-dsv41-3x"
        assert running.healthy
        assert running.nodes == ["node1", "node2", "node3"]
        status_shows_every_column(inventory, plan)
        deployment_run(
            env,
            "teardown/teardown",
            {"cluster": cluster, "recipe": "lab-dsv41-3x"},
            watch_timeout_s=300,
        )
    nothing_runs(cluster)


def status_shows_every_column(inventory: Cluster, plan: Plan) -> None:
    """What status says of the deployment just made: healthy since its start, probed by the
    sentinel, repaired never this hour, and its Engram copies on every node; the CLI's table
    and the status flow's artifact show the same columns."""
    with get_client(sync_client=True) as client:
        report = read_status(inventory, client, datetime.now(UTC))
        [artifact] = client.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(
                key=ArtifactCollectionFilterKey(any_=[artifact_key("status", inventory.name)])
            )
        )
    [row] = report.rows
    assert row["deployment"] == f"{plan.deployment_id} (lab-dsv41-3x)"
    assert row["health"] == "healthy"
    # Events of earlier tests on the session's server may name this deployment, never after
    # its start.
    assert row["healthy since"].endswith("its start: no fault since"), row
    assert row["last probe"].startswith("ok, "), row
    assert row["last fault"], row
    assert row["repairs this hour"] == "none"
    assert row["last smoke test"].startswith("passed, "), row
    on_nodes = row["bytes on each node"].split(", ")
    assert [cell.split()[0] for cell in on_nodes] == ["node1", "node2", "node3"], row
    assert all(cell.split()[2] in ("KiB", "MiB", "GiB") for cell in on_nodes), row
    assert all(f"| {column} |" in str(artifact.data) for column in COLUMNS)
    assert plan.deployment_id in str(artifact.data)
    shown = CliRunner().invoke(app, ["status", str(inventory.path)], env={"COLUMNS": "400"})
    assert shown.exit_code == 0, shown.output
    header, _, line = shown.output.splitlines()[:3]
    assert header.split("  ")[0] == "deployment"
    assert "bytes on each node" in header
    assert line.startswith(plan.deployment_id)
    assert "node1 " in line


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
