"""The flows on the lab, against a Prefect server: a full deploy through a worker and
`prefect deployment run`, status and teardown, a blocked recipe refused, the nightly prefetch.
What a deploy does when something breaks is tests/test_fault_matrix.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from lab_flows import nothing_runs, register_lab_deployments

from flows.deploy import deploy
from flows.prefetch_all import prefetch_all
from lab.prefect_local import run_prefect, start_worker
from lab.prefect_local import stop_worker as stop_prefect_worker
from sparkdeploy.errors import RecipeBlocked
from sparkdeploy.model.cluster import load_cluster
from sparkdeploy.model.project import load_plan
from sparkdeploy.remote import engine_http
from sparkdeploy.steps.status import cluster_status

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]


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
    register_lab_deployments(env)
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


def test_blocked_recipe_is_refused_quoting_its_reason(cluster: str) -> None:
    with pytest.raises(RecipeBlocked, match="GLM MLA parent-page stride") as refused:
        deploy("glm53-flash-r27-dflash2", cluster=cluster)
    assert "allow_blocked" in str(refused.value)
    nothing_runs(cluster)


def test_prefetch_all_fetches_every_deployable_lab_recipe_once(cluster: str) -> None:
    outcomes = prefetch_all(cluster=cluster, recipes="lab-*")
    assert sorted(outcome.repo for outcome in outcomes) == ["lab/tiny-chat", "lab/tiny-dsv41"]
    assert all(
        outcome.fetched_bytes == 0 for outcome in prefetch_all(cluster=cluster, recipes="lab-*")
    )
