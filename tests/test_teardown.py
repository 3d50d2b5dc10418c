"""Teardown's log handling: stdout/stderr merged in time order, earlier logs kept, clear errors;
which deployment a teardown of a recipe takes down."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkdeploy.errors import TeardownError
from sparkdeploy.remote.docker_cli import ContainerInfo, merge_timestamped
from sparkdeploy.spec.labels import DEPLOYMENT_LABEL, NODE_LABEL, RANK_LABEL, RECIPE_LABEL
from sparkdeploy.spec.plan import SPEC_LABEL
from sparkdeploy.steps.teardown import (
    Found,
    RecipeTeardown,
    _keep_log,
    recipe_deployments,
    recipe_teardown,
)


def test_streams_merge_by_timestamp_even_with_trimmed_fractions() -> None:
    stdout = "2026-01-01T00:00:01.5Z out-b\n2026-01-01T00:00:00.25Z out-a\n"
    stderr = "2026-01-01T00:00:01.123456789Z err-b\n2026-01-01T00:00:00.3Z err-a\n"
    merged = merge_timestamped(stdout, stderr).splitlines()
    assert [line.split(" ", 1)[1] for line in merged] == ["out-a", "err-a", "err-b", "out-b"]


def test_an_earlier_log_of_the_node_is_kept_aside(tmp_path: Path) -> None:
    first = _keep_log(str(tmp_path), "dep", "node1", "first boot\n")
    second = _keep_log(str(tmp_path), "dep", "node1", "second boot\n")
    third = _keep_log(str(tmp_path), "dep", "node1", "third boot\n")
    assert first == second == third == tmp_path / "dep" / "node1.log"
    assert third.read_text() == "third boot\n"
    assert (tmp_path / "dep" / "node1.1.log").read_text() == "first boot\n"
    assert (tmp_path / "dep" / "node1.2.log").read_text() == "second boot\n"
    assert sorted(p.name for p in (tmp_path / "dep").iterdir()) == [
        "node1.1.log",
        "node1.2.log",
        "node1.log",
    ]


def test_an_unwritable_runs_dir_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "runs"
    blocker.write_text("a file where the runs dir should be")
    with pytest.raises(TeardownError, match="runs_dir is mounted") as caught:
        _keep_log(str(blocker), "dep", "node1", "log\n")
    assert "node1" in str(caught.value)
    assert str(blocker) in str(caught.value)


def _container(deployment_id: str, node: str, spec: str = "s1") -> ContainerInfo:
    labels = {
        DEPLOYMENT_LABEL: deployment_id,
        RECIPE_LABEL: deployment_id.rsplit("-", 1)[0],
        NODE_LABEL: node,
        RANK_LABEL: "0",
        SPEC_LABEL: spec,
    }
    return ContainerInfo(deployment_id, f"c-{node}", "image", labels, "running", 0, "")


def test_a_recipes_deployments_are_found_by_container_labels_and_lock_records() -> None:
    found = recipe_deployments(
        "lab-x",
        {"node1": [_container("lab-x-0000000a", "node1")], "node2": []},
        # node2 held with no container left; node3 by another recipe, even one whose name
        # begins alike.
        {"node1": "lab-x-0000000a", "node2": "lab-x-0000000b", "node3": "lab-xy-0000000c"},
    )
    assert found == [
        Found("lab-x-0000000a", ("node1",), {"node1": "s1"}),
        Found("lab-x-0000000b", ("node2",)),
    ]


def test_the_plans_deployment_is_torn_down_when_it_runs_or_nothing_of_the_recipe_does() -> None:
    running = [Found("lab-x-0000000a", ("node1",), {"node1": "s1"})]
    chosen = recipe_teardown(
        "lab-x", "lab", running, plan_id="lab-x-0000000a", plan_specs={"node1": "s1"}
    )
    assert chosen == RecipeTeardown(True, [], [])
    assert recipe_teardown("lab-x", "lab", [], plan_id="lab-x-0000000a").by_plan
    # Same id, another spec: said, and torn down all the same.
    [note] = recipe_teardown(
        "lab-x", "lab", running, plan_id="lab-x-0000000a", plan_specs={"node1": "s2"}
    ).notes
    assert "recipe lab-x changed since lab-x-0000000a was deployed" in note


def test_a_changed_or_unplannable_recipe_is_torn_down_by_what_runs_of_it() -> None:
    old = Found("lab-x-0000000a", ("node1",))
    changed = recipe_teardown(
        "lab-x", "lab", [old], plan_id="lab-x-0000000b", plan_nodes=["node1", "node2"]
    )
    assert (changed.by_plan, changed.deployment_ids) == (False, ["lab-x-0000000a"])
    assert (
        "now plans deployment lab-x-0000000b on node1, node2, which does not run"
        in (changed.notes[0])
    )
    other = Found("lab-x-0000000c", ("node3",))
    gone = recipe_teardown("lab-x", "lab", [old, other], plan_id=None, unplanned="no recipe")
    assert gone.deployment_ids == ["lab-x-0000000a", "lab-x-0000000c"]
    assert "recipe lab-x cannot be planned (no recipe)" in gone.notes[0]
    on_node3 = recipe_teardown(
        "lab-x", "lab", [old, other], plan_id=None, unplanned="no recipe", nodes=["node3"]
    )
    assert on_node3.deployment_ids == ["lab-x-0000000c"]
    nothing = recipe_teardown("lab-x", "lab", [], plan_id=None, unplanned="no recipe")
    assert nothing.deployment_ids == []
    assert "nothing to tear down" in nothing.notes[0]
    # Which of several the changed recipe meant is not known: refused, naming them.
    with pytest.raises(TeardownError, match="lab-x-0000000a on node1; lab-x-0000000c on node3"):
        recipe_teardown("lab-x", "lab", [old, other], plan_id="lab-x-0000000b")
