"""Ensure semantics: a running copy judged against the plan (unit tests; the schedule firing on
the lab is in test_keepup_lab.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from sparkdeploy.remote.docker_cli import ContainerInfo
from sparkdeploy.remote.engine_http import ProbeOutcome
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import SPEC_LABEL, Plan, make_plan
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.steps.running_copy import NodeFacts, judge_running_copy

ROOT = Path(__file__).resolve().parent.parent
PLAN = make_plan(
    load_recipe(ROOT / "recipes" / "lab-dsv41-3x" / "recipe.toml"),
    load_cluster(ROOT / "clusters" / "dgx-spark-4.toml"),
)
IMAGE = "sha256:" + "1" * 64
READY = ProbeOutcome(True, "/v1/models lists ['dsv41']")


def as_planned(plan: Plan, **changes: object) -> dict[str, NodeFacts]:
    facts = {}
    for node in plan.nodes:
        container = ContainerInfo(
            id="c" * 64,
            name=node.container.name,
            image=plan.docker_image,
            labels=dict(node.container.labels),
            status="running",
            exit_code=0,
            started_at="2026-01-01T00:00:00Z",
            image_id=IMAGE,
        )
        facts[node.node] = NodeFacts([replace(container, **changes)], IMAGE, None)  # type: ignore[arg-type]
    return facts


def judge(facts: dict[str, NodeFacts], probe: ProbeOutcome | None = READY) -> tuple[str, str]:
    copy = judge_running_copy(PLAN, facts, context_digest=None, probe_outcome=probe)
    return copy.state, copy.reason


def test_the_same_deployment_serving_as_planned_is_left_alone() -> None:
    state, reason = judge(as_planned(PLAN))
    assert state == "serving"
    assert PLAN.deployment_id in reason


def test_nothing_running_is_absent() -> None:
    facts = {node.node: NodeFacts([], IMAGE, None) for node in PLAN.nodes}
    assert judge(facts, None)[0] == "absent"


def test_another_recipe_version_or_image_is_different() -> None:
    head = PLAN.nodes[0].node
    changed = as_planned(PLAN)
    old_labels = {**changed[head].containers[0].labels, SPEC_LABEL: "0123456789abcdef"}
    changed[head] = NodeFacts(
        [replace(changed[head].containers[0], labels=old_labels)], IMAGE, None
    )
    state, reason = judge(changed)
    assert state == "different"
    assert "runs spec 0123456789abcdef" in reason
    retagged = {
        name: NodeFacts(facts.containers, "sha256:" + "2" * 64, None)
        for name, facts in as_planned(PLAN).items()
    }
    state, reason = judge(retagged)
    assert state == "different"
    assert "now names sha256:22222222222" in reason


def test_a_dead_container_or_a_silent_head_is_unhealthy() -> None:
    worker = PLAN.nodes[1].node
    facts = as_planned(PLAN)
    facts[worker] = NodeFacts(
        [replace(facts[worker].containers[0], status="exited", exit_code=137)], IMAGE, None
    )
    state, reason = judge(facts)
    assert state == "unhealthy"
    assert f"{worker}'s container exited (137)" in reason
    state, reason = judge(as_planned(PLAN), ProbeOutcome(False, "/health answered 503"))
    assert state == "unhealthy"
    assert "/health answered 503" in reason


def test_a_copy_started_by_another_deploy_meanwhile_is_told_from_the_one_seen_before() -> None:
    before = judge_running_copy(
        PLAN, as_planned(PLAN, status="exited"), context_digest=None, probe_outcome=None
    )
    same = judge_running_copy(PLAN, as_planned(PLAN), context_digest=None, probe_outcome=READY)
    redeployed = judge_running_copy(
        PLAN, as_planned(PLAN, id="d" * 64), context_digest=None, probe_outcome=READY
    )
    assert before.state == "unhealthy"
    assert same.serving
    assert redeployed.serving
    assert not same.made_to_serve_since(same)  # the copy that failed its smoke test, say
    assert not same.made_to_serve_since(before)  # the same containers, restarted by hand
    assert redeployed.made_to_serve_since(before)
