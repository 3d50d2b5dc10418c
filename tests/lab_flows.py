"""Helpers of the flow tests on the lab: recipe variants written for one test, the check that
a deployment left nothing behind (no container of ours, no node held), and where the fault
matrix leaves its table of measured detection times for the end of the pytest output."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkdeploy.cluster import load_cluster
from sparkdeploy.locks import holders
from sparkdeploy.status import cluster_status


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


# (path of the table, the table) once tests/test_fault_matrix.py has measured its faults.
FAULT_MATRIX_TABLE = pytest.StashKey[tuple[str, str]]()
