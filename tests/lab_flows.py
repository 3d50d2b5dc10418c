"""Helpers of the flow tests on the lab: recipe variants written for one test, and the check
that a deployment left nothing behind (no container of ours, no node held)."""

from __future__ import annotations

from pathlib import Path

from sparkdeploy.model.cluster import load_cluster
from sparkdeploy.steps.hold_nodes import holders
from sparkdeploy.steps.status import cluster_status


def nothing_runs(cluster: str) -> None:
    inventory = load_cluster(Path(cluster))
    assert cluster_status(inventory) == []
    assert set(holders(inventory.name, [n.name for n in inventory.nodes]).values()) == {None}


def recipe_variant(tmp_path: Path, name: str, source: Path, *replacements: tuple[str, str]) -> str:
    """`source` with lines replaced, as <tmp>/<name>/recipe.toml; returns the recipe dir."""
    text = source.read_text()
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / name / "recipe.toml"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return str(path.parent)
