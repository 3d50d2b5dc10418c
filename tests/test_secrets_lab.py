"""A recipe that protects its API deploys on the lab, and its secrets are nowhere they could leak.

The recipe is lab-single with planted sentinels as `--api-key`, as `--hf-token` (which reaches
the engine as HF_TOKEN) and as SENTINEL_TOKEN in its [env]; the stand-in enforces the key as
vLLM does. The deploy's gate and smoke test, the watchdog's smoke test and status must all send
the key; then every Prefect record of those flow runs (parameters, task runs, logs, artifacts),
Prefect's result storage (the flows run with PREFECT_RESULTS_PERSIST_BY_DEFAULT=true), the plan
as `sparkdeploy plan` shows it, the NAS runs dir, and every node's process list and temporary
dirs are searched for the sentinels.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from secrets import token_hex
from uuid import UUID

import pytest
from lab_flows import LAB_SINGLE_RECIPE, nothing_runs, recipe_variant, settled_task_runs
from prefect.settings import (
    PREFECT_LOCAL_STORAGE_PATH,
    PREFECT_RESULTS_PERSIST_BY_DEFAULT,
    temporary_settings,
)
from test_result_storage import _readable_forms
from typer.testing import CliRunner

from flows.deploy import deploy
from flows.smoke import smoke
from flows.teardown import teardown
from lab.cluster import Lab
from lab.models import publish_lab_models
from sparkdeploy.cli import app
from sparkdeploy.remote import engine_http
from sparkdeploy.remote.ssh import cached_connection, close_cached
from sparkdeploy.remote.targets import cluster_targets, node_target
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import load_plan

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]

RECIPE = "lab-secret"


def _prefect_records(flow_run_ids: Iterable[UUID]) -> list[str]:
    """Every record the Prefect server keeps of these flow runs, as JSON texts."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    records: list[str] = []
    with get_client(sync_client=True) as client:
        for run_id in flow_run_ids:
            records.append(client.read_flow_run(run_id).model_dump_json())
            task_runs = settled_task_runs(run_id)
            records += [task_run.model_dump_json() for task_run in task_runs]
            in_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))
            offset = 0
            while page := client.read_logs(in_run, limit=200, offset=offset):
                records += [log.model_dump_json() for log in page]
                offset += len(page)
            artifacts = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
            found = client.read_artifacts(artifact_filter=artifacts)
            records += [artifact.model_dump_json() for artifact in found]
    return records


def _node_listings(cluster: str, sentinels: list[str]) -> dict[str, str]:
    """Each node's `ps -eo args`, and the files under its temporary dirs naming a sentinel
    (grep reads them from stdin, so its own argv names none)."""
    listings = {}
    for name, target in cluster_targets(load_cluster(Path(cluster))).items():
        runner = cached_connection(target)
        ps = runner.run(["ps", "-eo", "args"], timeout=30).stdout.decode()
        assert "ps -eo args" in ps  # the listing is real
        found = runner.run(
            ["grep", "-rlsF", "-D", "skip", "-f", "-", "/tmp", "/var/tmp"],
            timeout=60,
            stdin="\n".join(sentinels).encode() + b"\n",
            check=False,
        )
        listings[f"{name}: ps -eo args"] = ps
        listings[f"{name}: files under /tmp, /var/tmp naming a sentinel"] = found.stdout.decode()
    return listings


def test_a_protected_recipe_deploys_and_its_secrets_appear_nowhere(
    lab_cluster: Lab, lab_engine_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish_lab_models(lab_cluster.hub_repos_dir)
    cluster = str(lab_cluster.inventory_path)
    api_key, env_secret = f"sentinel{token_hex(8)}", f"sentinel{token_hex(8)}"
    hf_token = f"sentinel{token_hex(8)}"
    sentinels = [api_key, env_secret, hf_token]
    storage = tmp_path / "results"
    root = tmp_path / "project"
    recipe_variant(
        root / "recipes",
        RECIPE,
        LAB_SINGLE_RECIPE,
        (
            "args = [\n",
            f'args = [\n    "--api-key", "{api_key}",\n    "--hf-token", "{hf_token}",\n',
        ),
        ("[env]\n", f'[env]\nSENTINEL_TOKEN = "{env_secret}"\n'),
    )
    # The watchdog and status re-plan running deployments by recipe name, from the project root.
    monkeypatch.setenv("SPARKDEPLOY_ROOT", str(root))
    plan = load_plan(RECIPE, cluster)
    head = cached_connection(node_target(plan.nodes[0]))
    runs = []
    # Every task's and flow's result pickled into this storage, as a server so configured does.
    with temporary_settings(
        {PREFECT_RESULTS_PERSIST_BY_DEFAULT: True, PREFECT_LOCAL_STORAGE_PATH: storage}
    ):
        try:
            deployed = deploy(RECIPE, cluster=cluster, return_state=True)
            runs.append(deployed.state_details.flow_run_id)
            assert deployed.is_completed(), deployed.message
            # The engine guards /v1 with the key (and only /v1), and has the secret env.
            refused = engine_http.request("GET", f"{plan.endpoint}/v1/models", timeout=10)
            assert refused.status == 401
            assert engine_http.request("GET", f"{plan.endpoint}/health", timeout=10).status == 200
            printed = head.run(
                [
                    "docker",
                    "exec",
                    plan.nodes[0].container.name,
                    "python3",
                    "-c",
                    "import os; print(os.environ['SENTINEL_TOKEN'], os.environ['HF_TOKEN'])",
                ],
                timeout=30,
            )
            assert printed.stdout.decode().split() == [env_secret, hf_token]
            watched = smoke(cluster=cluster, return_state=True)
            runs.append(watched.state_details.flow_run_id)
            assert watched.is_completed(), watched.message
            assert [report.passed for report in watched.result()] == [True]
            places = _node_listings(cluster, sentinels)
        finally:
            torn = teardown(RECIPE, cluster=cluster, return_state=True)
            runs.append(torn.state_details.flow_run_id)
            close_cached()
    assert torn.is_completed(), torn.message

    records = _prefect_records(run for run in runs if run is not None)
    assert any("every check passed" in record for record in records)  # the search is real
    places.update({f"prefect record {i}": record for i, record in enumerate(records)})
    shown = CliRunner()
    for options in ([], ["--json"]):
        result = shown.invoke(app, ["plan", RECIPE, "--cluster", cluster, *options])
        assert result.exit_code == 0
        assert "***" in result.output
        places[f"sparkdeploy plan {' '.join(options)}"] = result.output
    saved = [path for path in Path(plan.runs_dir).rglob("*") if path.is_file()]
    assert any(plan.deployment_id in str(path) for path in saved)
    for path in saved:
        places[f"{path} (name)"] = str(path)
        places[str(path)] = path.read_text(errors="replace")

    stored = [path for path in storage.rglob("*") if path.is_file()]
    assert stored  # the storage is real: the flows' results went there
    for path in stored:
        for number, form in enumerate(_readable_forms(path.read_bytes())):
            places[f"{path} (form {number})"] = form.decode(errors="replace")
    leaks = [where for where, text in places.items() if any(s in text for s in sentinels)]
    assert leaks == []
    nothing_runs(cluster)
