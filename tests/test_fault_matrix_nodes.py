"""The fault matrix (tests/fault_matrix.py) on the nodes: a node daemon (sshd, dockerd) down
before the deploy, the registry down during a pull."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
from fault_matrix import (
    BOUND_AT_ONCE_S,
    FAULT_MATRIX_MARKS,
    deploys,
    node_processes,
    nothing_left,
    on_node,
    run_flow,
)
from lab_flows import Matrix

from flows.deploy import deploy
from flows.teardown import teardown
from lab.cluster import Lab
from sparkdeploy.remote.ssh import close_cached
from sparkdeploy.spec.project import load_plan

pytestmark = FAULT_MATRIX_MARKS


@contextlib.contextmanager
def stopped(lab: Lab, daemon: str) -> Iterator[float]:
    """The daemon down for the block (yields when it went); started again after it."""
    close_cached()  # the next deploy connects anew, as a deploy in its own process does
    lab.stop_daemon(daemon)
    try:
        yield time.time()
    finally:
        lab.start_daemon(daemon)


# A node daemon down before the deploy: the step that first needs it, what it must say, the row.
DAEMONS_DOWN = {
    "node1/sshd": (
        "hold-nodes",
        "cannot connect: .*[Cc]onnection refused.*is sshd running",
        "node sshd down before the deploy",
        "hold-nodes (the first SSH of a deploy: the node's machine id): connection refused,"
        " retried",
        "hold-nodes' retries add 5 + 30 s",
    ),
    "node1/dockerd": (
        "image",
        "Is the docker daemon running.*start dockerd there",
        "dockerd down",
        "image: the node probe finds no daemon on docker's socket (not retried)",
        "",
    ),
}


@pytest.mark.parametrize("daemon", sorted(DAEMONS_DOWN))
def test_a_node_daemon_down_fails_the_first_step_that_needs_it(
    cluster: str, lab_cluster: Lab, matrix: Matrix, daemon: str
) -> None:
    step, cause, fault, detected_by, field_note = DAEMONS_DOWN[daemon]
    with stopped(lab_cluster, daemon) as down_at:
        run = run_flow(deploy, "lab-single", cluster=cluster)
        assert run.failed
        attempt = run.named(step, node="node1", cause=cause)
    nothing_left(lab_cluster, cluster)
    attempts = len([a for a in run.attempts if a.task_run == attempt.task_run])
    matrix.record(
        fault,
        detected_by,
        attempt.at - down_at,
        BOUND_AT_ONCE_S,
        outcome=f"failed after {attempts} attempts, {run.ended_at - down_at:.0f} s",
        field_note=field_note,
    )


def test_the_registry_down_during_a_pull_is_retried_and_named(
    cluster: str, lab_cluster: Lab, matrix: Matrix
) -> None:
    """The nodes pull through the lab registry as their mirror; docker falls back to the
    upstream registry when the mirror is down, so the step asks the mirror itself."""
    image = load_plan("lab-single", cluster).nodes[0].container.image
    image_id = on_node(
        lab_cluster, "node1", "docker", "image", "inspect", "-f", "{{.Id}}", image, check=False
    )
    if image_id.strip():  # every tag of it, so the pull has layers to fetch
        on_node(lab_cluster, "node1", "docker", "image", "rm", "--force", image_id.strip())
    went_down: list[float] = []
    pulling = "docker pull"

    def stop_registry_once_pulling() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(pulling in cmd for _, _, cmd in node_processes(lab_cluster, "node1").values()):
                lab_cluster.stop_daemon("registry")
                went_down.append(time.time())
                return
            time.sleep(0.005)

    killer = threading.Thread(target=stop_registry_once_pulling)
    killer.start()
    try:
        run = run_flow(deploy, "lab-single", cluster=cluster)
    finally:
        killer.join()
        if went_down:
            lab_cluster.start_daemon("registry")
    assert went_down, "the pull never started"
    assert run.failed
    attempt = run.named("image", node="node1", cause="registry mirror .* does not answer")
    assert len([a for a in run.attempts if a.task_run == attempt.task_run]) == 3  # retried
    nothing_left(lab_cluster, cluster)
    matrix.record(
        "registry down during a pull",
        "image: the pull fails, the node finds its registry mirror not answering; retried",
        attempt.at - went_down[0],
        BOUND_AT_ONCE_S,
        outcome=f"failed after 3 attempts, {run.ended_at - went_down[0]:.0f} s",
        field_note="the retries add 15 + 60 s; a registry back within them recovers",
    )


def test_after_the_node_faults_the_recipe_deploys(cluster: str, lab_cluster: Lab) -> None:
    """The re-run of the three faults above, each cleared (the daemon started again, the
    image gone from node1 pulled anew): they left nothing, so one deploy shows it."""
    deploys("lab-single", cluster, skip=["smoke-test"])
    teardown("lab-single", cluster=cluster)
    nothing_left(lab_cluster, cluster)
