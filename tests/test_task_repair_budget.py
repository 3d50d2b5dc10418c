"""The repair budget's tasks against Prefect's test harness: a repair run is tagged and counted;
a repair that found the deployment redeployed by another gives its tag back and is not counted."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import get_client

from sparkdeploy.errors import RepairLimitReached
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import Plan, make_plan
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.steps.repair_budget import REPAIR_NOT_NEEDED_TAG, REPAIR_TAG
from tasks.repair_budget import refund_repair, start_repair
from tasks.runlabels import label_flow_run

ROOT = Path(__file__).parent.parent

pytestmark = pytest.mark.usefixtures("prefect_harness")


@pytest.fixture
def plan(tmp_path: Path) -> Plan:
    recipe = load_recipe(ROOT / "recipes" / "lab-single" / "recipe.toml")
    planned = make_plan(recipe, load_cluster(ROOT / "clusters" / "dgx-spark-4.toml"))
    # A deployment of this test's own: the harness's server lives for the whole session.
    return planned.model_copy(update={"deployment_id": f"repair-test-{tmp_path.name}"})


@flow(name="repair-budget-test")
def repair(plan: Plan, found_redeployed: bool) -> None:
    """What the deploy flow does with a repair: label, start it, refund it when it found the
    deployment redeployed while it waited."""
    label_flow_run(plan)
    start_repair(plan, "worker_died on dgx2", per_hour=2)
    if found_redeployed:
        refund_repair(plan)


def repair_tags(plan: Plan, *, found_redeployed: bool) -> set[str]:
    state = repair(plan, found_redeployed, return_state=True)
    state.result()
    run_id = state.state_details.flow_run_id
    assert run_id is not None
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
    return set(run.tags)


def test_a_repair_that_did_nothing_does_not_count_against_the_bound(plan: Plan) -> None:
    refunded = repair_tags(plan, found_redeployed=True)
    assert REPAIR_NOT_NEEDED_TAG in refunded
    assert REPAIR_TAG not in refunded
    for _ in range(2):
        assert REPAIR_TAG in repair_tags(plan, found_redeployed=False)
    with pytest.raises(RepairLimitReached, match=r"repaired 2 time\(s\) in the past hour"):
        repair_tags(plan, found_redeployed=False)
