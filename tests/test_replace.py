"""What a replacing deploy replaces and brings back, how node records are judged for it, and
what its run says when it rolls back (unit tests; the lab tests are in test_keepup_lab.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from sparkdeploy.errors import ReplaceRefused, RollbackFailed, RolledBack
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import Plan, make_plan
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.steps.hold_nodes import NodeHolder, Replaced, holder_decision
from sparkdeploy.steps.replace import bring_back, plan_replacement, rollback_message
from sparkdeploy.steps.status import DeploymentStatus, NodeContainer

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = load_cluster(ROOT / "clusters" / "dgx-spark-4.toml")
SINCE = "2026-01-01T00:00:00+00:00"
MACHINE = "0123456789abcdef0123456789abcdef"


def plan_of(recipe: str, nodes: list[str]) -> Plan:
    return make_plan(load_recipe(ROOT / "recipes" / recipe / "recipe.toml"), CLUSTER, nodes)


NEW = plan_of("lab-single", ["dgx2"])
OLD = plan_of("lab-dsv41-3x", ["dgx2", "dgx3", "dgx4"])


def running(plan: Plan, *, replannable: bool = True) -> DeploymentStatus:
    containers = [
        NodeContainer(node.node, node.rank, node.container.name, "running", 0, SINCE)
        for node in plan.nodes
    ]
    return DeploymentStatus(
        plan.deployment_id,
        plan.recipe,
        containers,
        plan if replannable else None,
        True,
        "ready" if replannable else "cannot re-plan: no recipe named 'gone' under recipes/",
    )


def held(deployment_id: str, run: str, replaces: Replaced | None = None) -> NodeHolder:
    return NodeHolder("dgx2", deployment_id, SINCE, run, "dgx-spark-4", MACHINE, replaces)


def ended(*runs: str) -> Callable[[str | None], bool]:
    return lambda run: run in runs


def test_a_deployment_whose_run_ended_is_replaced_and_would_come_back_on_all_its_nodes() -> None:
    replacement = plan_replacement(
        NEW, {"dgx2": held(OLD.deployment_id, "run-old")}, ended("run-old"), [running(OLD)]
    )
    [old] = replacement.bring_back
    assert old == Replaced(OLD.deployment_id, "lab-dsv41-3x", ("dgx2", "dgx3", "dgx4"), SINCE)
    assert replacement.replacing == {OLD.deployment_id: old}
    assert "replaces " + OLD.deployment_id in replacement.describe(NEW.deployment_id)


def test_what_is_not_replaced() -> None:
    # A deploy still going is waited for; a holder with nothing left is taken over as always;
    # the deployment itself is redeployed, not replaced.
    for holder, runs_ended, statuses in (
        (held(OLD.deployment_id, "run-live"), ended(), [running(OLD)]),
        (held(OLD.deployment_id, "run-old"), ended("run-old"), []),
        (held(NEW.deployment_id, "run-old"), ended("run-old"), [running(NEW)]),
    ):
        replacement = plan_replacement(NEW, {"dgx2": holder}, runs_ended, statuses)
        assert replacement.replacing == {}
        assert replacement.bring_back == []


def test_a_deployment_that_could_not_be_brought_back_is_refused() -> None:
    with pytest.raises(ReplaceRefused, match=f"cannot replace deployment {OLD.deployment_id}"):
        plan_replacement(
            NEW,
            {"dgx2": held(OLD.deployment_id, "run-old")},
            ended("run-old"),
            [running(OLD, replannable=False)],
        )


def test_a_killed_replacement_hands_down_what_served_before_it() -> None:
    """Y was replacing OLD when its process was killed: the next replacing deploy takes Y's
    record over and would bring back OLD, never Y's half-started containers."""
    before = Replaced(OLD.deployment_id, "lab-dsv41-3x", ("dgx2", "dgx3", "dgx4"), SINCE)
    killed = held("lab-other-0badc0de", "run-killed", replaces=before)
    replacement = plan_replacement(NEW, {"dgx2": killed}, ended("run-killed"), [])
    assert replacement.replacing == {"lab-other-0badc0de": before}
    assert replacement.bring_back == [before]
    # Deploying OLD itself over the killed attempt: nothing to bring back.
    replacement = plan_replacement(OLD, {"dgx2": killed}, ended("run-killed"), [])
    assert replacement.replacing == {"lab-other-0badc0de": before}
    assert replacement.bring_back == []


def test_node_records_are_judged_for_a_replacement() -> None:
    other = NodeHolder("n1", "dep-old", SINCE, "run-old", "lab", MACHINE)

    def decide(holder: NodeHolder, ended: bool, left: bool | None, replacing: bool) -> str:
        return holder_decision(
            holder,
            "dep-new",
            "run-new",
            run_ended=ended,
            containers_left=left,
            replacing=replacing,
        )

    # Replaced: taken over although its containers still run (boot removes them).
    assert decide(other, True, True, True) == "take over"
    # A deploy still going is never replaced under its feet.
    assert decide(other, False, True, True) == "wait"
    # Without replace the refusal stands.
    assert decide(other, True, True, False) == "wait"


def test_the_rollback_message_names_what_serves_again() -> None:
    failure = RuntimeError("smoke test of 'tiny-chat' failed 1 of 9 checks:\n  no_token_loops: ...")
    message = rollback_message(failure, NEW, [OLD])
    first, second = message.splitlines()[:2]
    assert first == (
        f"{NEW.deployment_id} (lab-single) failed: smoke test of 'tiny-chat' failed 1 of 9 checks"
    )
    assert second == (
        f"rolled back to {OLD.deployment_id} (lab-dsv41-3x on dgx2, dgx3, dgx4), which is serving"
        f" again at {OLD.endpoint}"
    )
    lost = Replaced(OLD.deployment_id, "lab-dsv41-3x", ("dgx2", "dgx3", "dgx4"), SINCE)
    message = rollback_message(failure, NEW, [], [(lost, RuntimeError("boot failed"))])
    assert f"rolling back to {OLD.deployment_id}" in message
    assert "failed too: boot failed" in message
    assert "nothing of ours serves on dgx2, dgx3, dgx4" in message


def test_bringing_back_tries_every_replaced_deployment_and_names_those_it_could_not() -> None:
    failure = RuntimeError("boot failed")
    old = Replaced(OLD.deployment_id, "lab-dsv41-3x", ("dgx2", "dgx3", "dgx4"), SINCE)
    lost = Replaced("lab-gone-0badc0de", "gone", ("dgx1",), SINCE)
    tried: list[Replaced] = []

    def redeploy(replaced: Replaced) -> Plan:
        tried.append(replaced)
        if replaced == lost:
            raise RuntimeError("no recipe named 'gone'")
        return OLD

    assert isinstance(bring_back(failure, NEW, [old], redeploy), RolledBack)
    error = bring_back(failure, NEW, [lost, old], redeploy)
    assert isinstance(error, RollbackFailed)
    assert tried == [old, lost, old]
    assert f"rolled back to {OLD.deployment_id}" in str(error)
    assert "rolling back to lab-gone-0badc0de (gone on dgx1) failed too" in str(error)
