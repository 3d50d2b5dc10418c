"""The quality gate on the lab (issue 26): an engine that answers 5 % of its free-text requests
with typos passes its smoke test and fails its gate, naming the rate and the threshold; a
replacement that fails the gate rolls back; external evals, a command on the ops host and an
image on the head node, score real requests to the endpoint and their scores are in the
artifact."""

from __future__ import annotations

from pathlib import Path

import pytest
from lab_flows import (
    LAB_SINGLE_RECIPE,
    answers_the_canary,
    artifact_rows,
    nothing_runs,
    recipe_variant,
    task_history,
    with_env,
)

from flows.deploy import deploy
from flows.teardown import teardown
from sparkdeploy.errors import QualityFailed, RolledBack
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import load_plan
from sparkdeploy.steps.hold_nodes import holders
from sparkdeploy.steps.status import cluster_status

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness", "clean_lab_after")]

LAB_QUALITY_RECIPE = LAB_SINGLE_RECIPE.parent.parent / "lab-quality" / "recipe.toml"
# lab-quality's engine with the typos fault, gated by the typo rate alone.
TYPOS = with_env(STANDIN_FAULT="typos:0.05")


def worse_variant(tmp_path: Path) -> str:
    """lab-quality with the typos fault and its typo rate as its only eval."""
    text = LAB_QUALITY_RECIPE.read_text()
    gate = text[: text.index("[quality.exact_answers]")]
    source = tmp_path / "source.toml"
    source.write_text(gate)
    return recipe_variant(tmp_path, "lab-typos", source, TYPOS)


def smoke_checks(flow_run_id: str, deployment_id: str) -> dict[str, object]:
    rows = artifact_rows(flow_run_id, f"smoke-test-{deployment_id}")
    return {str(row["check"]): row["result"] for row in rows if row["result"] != "info"}


def test_typos_in_5_percent_of_answers_pass_the_smoke_test_and_fail_the_gate(
    cluster: str, tmp_path: Path
) -> None:
    worse = worse_variant(tmp_path)
    worse_id = load_plan(worse, cluster).deployment_id
    state = deploy(worse, cluster=cluster, return_state=True)
    assert state.is_failed()
    with pytest.raises(QualityFailed) as failed:
        state.result()
    message = str(failed.value)
    print(message)
    assert "quality gate of 'tiny-chat' at http://" in message
    assert "1 of 1 evals failed:\n  typo_rate " in message
    assert " over 20 samples: above the threshold ≤ 0.20 % (" in message
    rate = message.split("  typo_rate ")[1].split(" %")[0]
    assert float(rate) > 1.0, message  # one answer in 20, every second long word misspelled
    run_id = str(state.state_details.flow_run_id)
    smoke = smoke_checks(run_id, worse_id)
    assert smoke, smoke
    assert set(smoke.values()) == {"pass"}, smoke
    history = task_history(run_id, settled=True)
    print("\n".join(history))
    # A step that completed in the failed transaction is marked RolledBack (a failed one, Failed).
    assert f"smoke-test {worse_id}: RolledBack" in history
    assert f"quality-gate {worse_id}: Failed" in history
    rows = artifact_rows(run_id, f"quality-{worse_id}")
    assert [(row["eval"], row["result"], row["samples"]) for row in rows] == [
        ("typo_rate", "FAIL", "20")
    ]
    assert rows[0]["threshold"] == "≤ 0.20 %"
    assert rows[0]["score"] == f"{rate} %"
    nothing_runs(cluster)  # a failed step from the boot on tears the deployment down


def test_external_evals_score_real_requests_and_a_worse_replacement_rolls_back(
    cluster: str, tmp_path: Path
) -> None:
    state = deploy("lab-quality", cluster=cluster, return_state=True)
    serving = state.result()
    rows = {
        str(row["eval"]): row
        for row in artifact_rows(
            str(state.state_details.flow_run_id), f"quality-{serving.deployment_id}"
        )
    }
    print("\n".join(str(row) for row in rows.values()))
    assert list(rows) == ["typo_rate", "exact_answers", "answers-ops-host", "answers-image"]
    assert all(row["result"] == "pass" for row in rows.values())
    assert rows["typo_rate"]["score"] == "0.00 %"
    assert rows["exact_answers"]["score"] == "100.0 %"
    for name, where in (("answers-ops-host", "the ops host"), ("answers-image", "on node1")):
        assert rows[name]["score"] == "100"
        assert rows[name]["threshold"] == "≥ 100"
        assert rows[name]["samples"] == "—"
        assert float(str(rows[name]["seconds"])) > 0
        assert where in str(rows[name]["evidence"])
        assert "exit 0" in str(rows[name]["evidence"])

    worse = worse_variant(tmp_path)
    with pytest.raises(RolledBack) as rolled:
        deploy(worse, cluster=cluster, replace=True)
    message = str(rolled.value)
    print(message)
    assert "typo_rate " in message
    assert "above the threshold ≤ 0.20 %" in message
    assert (
        f"rolled back to {serving.deployment_id} (lab-quality on node1), which is serving again"
    ) in message
    inventory = load_cluster(Path(cluster))
    [running] = cluster_status(inventory)
    assert running.deployment_id == serving.deployment_id
    assert answers_the_canary(serving.endpoint)
    holder = holders(inventory.name, ["node1"])["node1"]
    assert holder is not None
    assert holder.flow_run_id is not None
    history = task_history(holder.flow_run_id, settled=True)
    print("\n".join(history))
    worse_id = load_plan(worse, cluster).deployment_id
    assert f"smoke-test {worse_id}: RolledBack" in history
    assert f"quality-gate {worse_id}: Failed" in history
    assert f"boot {worse_id}: RolledBack" in history
    # Brought back as it was deployed: its own quality gate passed again.
    assert f"quality-gate {serving.deployment_id}: Completed" in history
    teardown("lab-quality", cluster=cluster)
    nothing_runs(cluster)
