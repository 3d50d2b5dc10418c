"""The fault matrix (tests/fault_matrix.py) on the node locks: two deploys racing for
overlapping nodes, the lab rebuilt under held locks."""

from __future__ import annotations

import threading
from pathlib import Path

from fault_matrix import (
    BOUND_AT_ONCE_S,
    FAULT_MATRIX_MARKS,
    TWO_NODES,
    Run,
    deploys,
    nothing_left,
    on_node,
    run_flow,
)
from lab_flows import LAB_DSV41_RECIPE, LAB_SINGLE_RECIPE, Matrix, nothing_runs, recipe_variant

from flows.deploy import deploy
from flows.teardown import teardown
from lab.cluster import Lab
from lab.image import build_engine_image
from lab.models import publish_lab_models
from sparkdeploy.remote.ssh import close_cached
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import load_plan
from sparkdeploy.steps.hold_nodes import holders
from sparkdeploy.steps.status import cluster_status

pytestmark = FAULT_MATRIX_MARKS


def test_two_deploys_racing_for_overlapping_nodes_never_both_run(
    cluster: str, lab_cluster: Lab, tmp_path: Path, matrix: Matrix
) -> None:
    """Started at the same moment: one takes its nodes, the other waits its lock_timeout_s
    and fails naming the first. A deploy that waits puts nothing on any node, not even on the
    nodes no one holds."""
    two_nodes = recipe_variant(tmp_path, "lab-two", LAB_SINGLE_RECIPE, *TWO_NODES)
    runs: dict[str, Run] = {}

    def race(recipe: str) -> None:
        runs[recipe] = run_flow(
            deploy, recipe, cluster=cluster, skip=["smoke-test"], lock_timeout_s=3
        )

    racers = [threading.Thread(target=race, args=(recipe,)) for recipe in ("lab-single", two_nodes)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    [won] = [recipe for recipe, run in runs.items() if run.state.is_completed()]
    [lost] = [recipe for recipe in runs if recipe != won]
    holder = load_plan(won, cluster).deployment_id
    attempt = runs[lost].named("hold-nodes", node="node1", cause=f"held by deployment {holder}")
    composing = recipe_variant(tmp_path, "lab-dsv41-wait", LAB_DSV41_RECIPE)
    waited = run_flow(deploy, composing, cluster=cluster, lock_timeout_s=1)
    waited.named("hold-nodes", node="node1", cause=f"held by deployment {holder}")
    for node in load_plan(composing, cluster).nodes:
        assert node.composed is not None
        listed = on_node(lab_cluster, node.node, "ls", "-d", node.composed.root, check=False)
        assert not listed, f"{node.node} has {node.composed.root}"
    [running] = cluster_status(load_cluster(Path(cluster)))
    assert running.deployment_id == holder, running
    assert {container.status for container in running.containers} == {"running"}, running
    teardown(won, cluster=cluster)
    assert [report.removed for report in teardown(won, cluster=cluster)] == [[]]  # idempotent
    nothing_left(lab_cluster, cluster)
    matrix.record(
        "two deploys racing for overlapping nodes",
        "hold-nodes: all of a deploy's nodes in one request; the other waits, then names it",
        attempt.at - runs[lost].started_at,
        3 + BOUND_AT_ONCE_S,
        field_note="waits lock_timeout_s (600 s by default; 3 s here)",
    )
    deploys(lost, cluster, skip=["smoke-test"])
    teardown(lost, cluster=cluster)
    nothing_left(lab_cluster, cluster)


def test_the_lab_rebuilt_under_held_locks_is_taken_over_at_once(
    lab_cluster: Lab, lab_engine_image: str, tmp_path: Path, matrix: Matrix
) -> None:
    """A lab of its own (one node): lab-single deployed, the lab brought down and up again (the
    nodes wiped, as a reboot or a re-imaged node does) while Prefect still records the node as
    held. The next deploy, of another recipe, takes it over at once, naming the old holder."""
    rebuilt = Lab(f"{lab_cluster.name[:17]}-rb", 1)
    cluster = str(rebuilt.inventory_path)
    other = recipe_variant(tmp_path, "lab-other", LAB_SINGLE_RECIPE)

    def bring_up() -> None:
        rebuilt.up()
        build_engine_image(rebuilt)
        publish_lab_models(rebuilt.hub_repos_dir)

    try:
        bring_up()
        deploys("lab-single", cluster, skip=["smoke-test"])
        old = holders(rebuilt.name, ["node1"])["node1"]
        assert old is not None
        close_cached()
        rebuilt.down()
        bring_up()
        run = deploys(other, cluster, skip=["smoke-test"], lock_timeout_s=60)
        said, at = next((message, at) for message, at in run.logs if "taking it over" in message)
        assert old.deployment_id in said, said
        assert str(old.flow_run_id) in said, said
        teardown(other, cluster=cluster)
        nothing_runs(cluster)
    finally:
        close_cached()
        rebuilt.down()
    matrix.record(
        "the lab rebuilt under held locks",
        "hold-nodes: the holder's flow run has ended and none of its containers is on the node",
        at - run.started_at,
        BOUND_AT_ONCE_S,
        outcome="taken over at once",
    )
