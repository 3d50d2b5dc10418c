"""The status view: each deployment's uptime, last smoke test and last event (unit test)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from sparkdeploy.report.history import event_text, smoke_text
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import make_plan
from sparkdeploy.spec.recipe import load_recipe
from sparkdeploy.steps.status import DeploymentStatus, NodeContainer

ROOT = Path(__file__).resolve().parent.parent
PLAN = make_plan(
    load_recipe(ROOT / "recipes" / "real-lab-2x" / "recipe.toml"),
    load_cluster(ROOT / "clusters" / "dgx-spark-4.toml"),
)
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def test_the_status_view_reads_last_smoke_test_last_event_and_uptime() -> None:
    an_hour_ago = NOW - timedelta(minutes=62)
    assert smoke_text(
        "Smoke test of 'x' at http://h:8000 (r): every check passed", an_hour_ago, NOW
    ) == ("passed, 1 h 2 min ago")
    assert smoke_text("Smoke test of 'x' at http://h:8000 (r): 2 check(s) FAILED", NOW, NOW) == (
        "FAILED (2 check(s) FAILED), 0 s ago"
    )
    assert smoke_text(None, None, NOW) == "none yet"
    text = event_text(
        "sparkdeploy.deployment.unhealthy",
        NOW - timedelta(minutes=5),
        {"node": "dgx2", "kind": "worker_died", "cause": "dgx2 exited with code 137"},
        NOW,
    )
    assert text == "unhealthy: dgx2 worker_died (dgx2 exited with code 137), 5 min ago"
    containers = [
        NodeContainer("dgx1", 0, "c0", "running", 0, "2026-01-01T09:30:00.123456789Z"),
        NodeContainer("dgx2", 1, "c1", "running", 0, "2026-01-01T09:31:00Z"),
    ]
    status = DeploymentStatus(PLAN.deployment_id, PLAN.recipe, containers, PLAN, True, "ready")
    assert status.uptime(NOW) == "2 h 29 min"
    stopped = [containers[0], NodeContainer("dgx2", 1, "c1", "exited", 137, "")]
    assert DeploymentStatus(PLAN.deployment_id, PLAN.recipe, stopped, PLAN, False, "x").uptime(
        NOW
    ) == ("dgx2 exited (137)")
