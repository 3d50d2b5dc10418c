"""The watchdog's diagnosis of a deployment that stopped serving, on real vLLM 0.32 logs.

mn2-head.log is the head of a real two-node TP 2 engine whose worker was SIGKILLed after ready
(recorded on one host: the peer address is rewritten to the plan's worker fabric address).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkdeploy.remote.docker_cli import ContainerInfo
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import Plan, make_plan
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.steps.watchdog import NodeState, diagnose

ROOT = Path(__file__).resolve().parent.parent
LOGS = Path(__file__).resolve().parent / "fixtures" / "vllm-0.32-cpu"


@pytest.fixture(scope="module")
def plan() -> Plan:
    recipe = load_recipe(ROOT / "recipes" / "real-lab-2x" / "recipe.toml")
    return make_plan(recipe, load_cluster(ROOT / "clusters" / "dgx-spark-4.toml"))


def container(status: str, exit_code: int = 0) -> ContainerInfo:
    return ContainerInfo("c0ffee", "engine", "image", {}, status, exit_code, "")


def head_log(plan: Plan, name: str) -> list[str]:
    worker_ip = plan.nodes[1].fabric_ip
    return (LOGS / name).read_text().replace("[127.0.0.1]", f"[{worker_ip}]").split("\n")


def until_ready(log: list[str]) -> list[str]:
    ready = next(i for i, line in enumerate(log) if "Application startup complete." in line)
    return log[: ready + 1]


def states(
    plan: Plan, log: list[str], head: ContainerInfo | None, worker: ContainerInfo | None
) -> dict[str, NodeState]:
    head_node, worker_node = (node.node for node in plan.nodes)
    return {
        head_node: NodeState(head_node, head, log),
        worker_node: NodeState(worker_node, worker, []),
    }


def test_a_worker_killed_after_ready_is_named_from_the_head_log_and_its_exit(plan: Plan) -> None:
    log = head_log(plan, "mn2-head.log")
    down = diagnose(plan, states(plan, log, container("exited", 0), container("exited", 137)))
    assert down is not None
    assert (down.node, down.kind) == ("dgx2", "worker_died")
    assert "dgx2 exited with code 137" in down.cause
    assert "the head (dgx1) stopped before any teardown" in down.cause
    assert any("Connection closed by peer" in line for line in down.excerpt)


def test_the_head_log_alone_names_the_worker_while_its_container_looks_alive(plan: Plan) -> None:
    """The worker's node may still list its container (e.g. the engine process died inside)."""
    log = head_log(plan, "mn4-head.log")
    down = diagnose(plan, states(plan, log, container("running"), container("running")))
    assert down is not None
    assert down.node == "dgx2"
    assert down.kind == "worker_died"


def test_a_head_stopped_by_someone_else_is_down_not_stopped(plan: Plan) -> None:
    """mn3: the head got a SIGTERM (not from a teardown) and exited 0; its worker runs on."""
    log = head_log(plan, "mn3-head.log")
    down = diagnose(plan, states(plan, log, container("exited", 0), container("running")))
    assert down is not None
    assert (down.node, down.kind) == ("dgx1", "head_exited")
    assert "dgx1 exited with code 0" in str(down)


def test_a_missing_worker_container_is_named(plan: Plan) -> None:
    log = until_ready(head_log(plan, "mn3-head.log"))
    down = diagnose(plan, states(plan, log, container("running"), None))
    assert down is not None
    assert down.node == "dgx2"
    assert "has no container" in down.cause


def test_a_healthy_deployment_has_no_diagnosis(plan: Plan) -> None:
    log = until_ready(head_log(plan, "mn3-head.log"))
    assert diagnose(plan, states(plan, log, container("running"), container("running"))) is None
