"""The deployments prefect.yaml and lab/prefect.yaml register: the scheduled ensure for the
team's cluster, off until turned on, and the nightly prune, a dry run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).parent.parent


def deployment(prefect_file: Path, entrypoint: str, name: str) -> dict[str, Any]:
    deployments = yaml.safe_load(prefect_file.read_text())["deployments"]
    found = [d for d in deployments if (d["entrypoint"], d["name"]) == (entrypoint, name)]
    assert len(found) == 1, f"{prefect_file}: {entrypoint} {name}"
    return dict(found[0])


def test_the_teams_ensure_deploy_is_registered_with_its_schedule_off() -> None:
    ensure = deployment(ROOT / "prefect.yaml", "flows/deploy.py:deploy", "ensure-dsv41")
    assert ensure["parameters"] == {
        "recipe": "dsv41-flash-eugr-0913-4x",
        "cluster": "dgx-spark-4",
        "ensure": True,
    }
    assert [s["active"] for s in ensure["schedules"]] == [False]
    assert ensure["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    assert (ROOT / "recipes" / "dsv41-flash-eugr-0913-4x" / "recipe.toml").is_file()


def test_the_nightly_prune_is_a_dry_run_on_both_clusters() -> None:
    for prefect_file, cluster in (
        (ROOT / "prefect.yaml", "dgx-spark-4"),
        (ROOT / "lab" / "prefect.yaml", "lab"),
    ):
        nightly = deployment(prefect_file, "flows/prune.py:prune", "nightly")
        assert nightly["parameters"] == {"cluster": cluster, "dry_run": True}
        assert [s.get("active", True) for s in nightly["schedules"]] == [True]
