"""The watchdog's health events (unit test)."""

from __future__ import annotations

from pathlib import Path

from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.events import UNHEALTHY, Health, health_event
from sparkdeploy.spec.plan import make_plan
from sparkdeploy.spec.recipe_loading import load_recipe

ROOT = Path(__file__).resolve().parent.parent
PLAN = make_plan(
    load_recipe(ROOT / "recipes" / "real-lab-2x" / "recipe.toml"),
    load_cluster(ROOT / "clusters" / "dgx-spark-4.toml"),
)


def test_an_unhealthy_event_names_the_deployment_node_and_cause_and_how_to_redeploy() -> None:
    event = health_event(
        PLAN, "dgx-spark-4", Health(False, "dgx2", "worker_died", "dgx2 exited with code 137")
    )
    assert event["event"] == UNHEALTHY == "sparkdeploy.deployment.unhealthy"
    resource = event["resource"]
    assert resource["prefect.resource.id"] == f"sparkdeploy.deployment.{PLAN.deployment_id}"
    assert resource["sparkdeploy.node"] == "dgx2"
    assert resource["sparkdeploy.nodes"] == "dgx1,dgx2"
    assert all(isinstance(value, str) for value in resource.values())  # labels are strings
    payload = event["payload"]
    assert (payload["recipe"], payload["cluster"], payload["nodes"]) == (
        "real-lab-2x",
        "dgx-spark-4",
        ["dgx1", "dgx2"],
    )
    assert (payload["kind"], payload["cause"]) == ("worker_died", "dgx2 exited with code 137")
    assert (
        health_event(PLAN, "dgx-spark-4", Health.ok(PLAN))["event"]
        == "sparkdeploy.deployment.healthy"
    )
