"""Readiness over real SSH on the lab: Connection.stream_lines, then sparkdeploy.steps.follow_logs
following engine stand-in containers on the lab nodes (good boot, fatal lines on the head and on
a worker, a SIGKILL from outside that is no OOM kill, a missing container). The faults through
the whole deploy are tests/test_fault_matrix.py."""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path

import pytest
from readiness_lab import Deployment, lab_plan

from lab.cluster import Lab
from sparkdeploy.errors import BootFailed
from sparkdeploy.model.plan import Plan
from sparkdeploy.remote.ssh import Connection, cached_connection
from sparkdeploy.remote.targets import node_target
from sparkdeploy.steps.follow_logs import gate_for, wait_until_ready

pytestmark = pytest.mark.lab

GOOD_BOOT_S = 90.0
# A fault shows within seconds; the timeout only bounds a test that went wrong.
FAULT_BOOT_S = 60.0
PROCESS_GONE_S = 5.0


@pytest.fixture
def node1(lab_cluster: Lab) -> Connection:
    return cached_connection(lab_cluster.ssh_target(lab_cluster.nodes[0]))


def test_stream_lines_merges_stdout_and_stderr_in_order_then_gives_the_exit_code(
    node1: Connection,
) -> None:
    script = "echo one; echo two >&2; sleep 0.2; printf 'three\\r\\nno newline'; exit 3"
    stream = node1.stream_lines(["sh", "-c", script], timeout=10)
    assert list(stream) == [b"one", b"two", b"three", b"no newline"]
    assert (stream.ended, stream.exit_code) == ("exited", 3)


def _running_on_node(connection: Connection, token: str) -> bool:
    listing = connection.run(["ps", "-eo", "args"], timeout=10).stdout.decode()
    return any(token in line and "ps -eo" not in line for line in listing.splitlines())


def test_stream_lines_ends_when_stopped_and_the_remote_command_goes(node1: Connection) -> None:
    token = secrets.token_hex(6)
    stop = threading.Event()
    stream = node1.stream_lines(
        ["sh", "-c", f"while sleep 0.1; do echo tick-{token}; done"], timeout=60, stop=stop
    )
    received = []
    for line in stream:
        received.append(line)
        if len(received) == 3:
            stop.set()
    assert received == [f"tick-{token}".encode()] * 3
    assert (stream.ended, stream.exit_code) == ("stopped", None)
    deadline = time.monotonic() + PROCESS_GONE_S
    while _running_on_node(node1, token) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running_on_node(node1, token), "the remote loop outlived its stream"


def test_stream_lines_ends_at_its_timeout_and_when_idle(node1: Connection) -> None:
    timed = node1.stream_lines(["sh", "-c", "while sleep 0.1; do echo tick; done"], timeout=1)
    assert set(timed) <= {b"tick"} and (timed.ended, timed.exit_code) == ("timeout", None)
    idle = node1.stream_lines(["sh", "-c", "echo once; sleep 5"], timeout=30, idle_timeout=0.5)
    assert list(idle) == [b"once"] and (idle.ended, idle.exit_code) == ("idle", None)


# -- readiness of stand-in containers ----------------------------------------------------------


def deploy(
    lab: Lab, tmp_path: Path, started: list[Deployment], *, nodes: int, fault: str = ""
) -> Deployment:
    name = f"ready-{secrets.token_hex(3)}"
    deployment = Deployment(lab_plan(lab, tmp_path / "recipes", name, nodes=nodes, fault=fault))
    started.append(deployment)
    deployment.start()
    return deployment


def test_three_nodes_are_ready_with_the_timeline_of_every_node(
    lab_cluster: Lab, tmp_path: Path, deployments: list[Deployment]
) -> None:
    plan = deploy(lab_cluster, tmp_path, deployments, nodes=3).plan
    gate = gate_for(plan)
    result = wait_until_ready(plan, gate, timeout_s=GOOD_BOOT_S)
    head, *workers = [node.node for node in plan.nodes]
    joined = [entry.node for entry in result.timeline if entry.marker == "headless_worker_joined"]
    assert sorted(joined) == workers
    head_markers = [entry.marker for entry in result.timeline if entry.node == head]
    assert head_markers[-3:] == ["application_ready", "endpoint_healthy", "endpoint_ready"]
    assert result.figures["kv_cache_tokens"] > 0 and result.figures["max_concurrency"] > 0
    assert gate.timeline == result.timeline


@pytest.mark.parametrize(
    ("fault", "rank", "kind", "quoted"),
    [
        # @0: both ranks load at once once they joined (as in vLLM); only the head fails here
        ("fatal:cuda_oom@0", 0, "cuda_out_of_memory", "CUDA out of memory"),
        ("fatal:free_memory@1", 1, "free_memory_below_utilization", "Free memory on device"),
    ],
)
def test_a_fatal_line_fails_naming_the_node_and_the_cause(
    lab_cluster: Lab,
    tmp_path: Path,
    deployments: list[Deployment],
    fault: str,
    rank: int,
    kind: str,
    quoted: str,
) -> None:
    plan = deploy(lab_cluster, tmp_path, deployments, nodes=2, fault=fault).plan
    gate = gate_for(plan)
    with pytest.raises(BootFailed) as caught:
        wait_until_ready(plan, gate, timeout_s=FAULT_BOOT_S)
    error = caught.value
    assert (error.node, error.kind) == (plan.nodes[rank].node, kind)
    assert quoted in error.cause and any(quoted in line for line in error.excerpt)
    assert f"boot failed on {plan.nodes[rank].node}" in str(error)


def _run_by_hand(plan: Plan, options: list[str], argv: list[str]) -> None:
    """The plan's container started with other options and command (its labels kept, so the
    `deployments` fixture finds and removes it)."""
    spec = plan.nodes[0].container
    labels = [arg for key, value in spec.labels.items() for arg in ("--label", f"{key}={value}")]
    cached_connection(node_target(plan.nodes[0])).run(
        ["docker", "run", "-d", "--name", spec.name, *labels, *options, spec.image, *argv],
        timeout=120,
    )


def test_a_docker_kill_is_named_killed(
    lab_cluster: Lab, tmp_path: Path, deployments: list[Deployment]
) -> None:
    plan = lab_plan(lab_cluster, tmp_path / "recipes", "docker-kill", nodes=1)
    deployments.append(Deployment(plan))
    _run_by_hand(plan, ["--entrypoint", "sleep"], ["600"])
    name = plan.nodes[0].container.name
    killer = threading.Timer(
        2.0,
        lambda: cached_connection(node_target(plan.nodes[0])).run(
            ["docker", "kill", name], timeout=60
        ),
    )
    killer.start()
    try:
        with pytest.raises(BootFailed) as caught:
            wait_until_ready(plan, gate_for(plan), timeout_s=FAULT_BOOT_S)
    finally:
        killer.join()
    assert (caught.value.node, caught.value.kind) == (plan.nodes[0].node, "killed")
    assert "not an OOM: State.OOMKilled is false" in caught.value.cause


def test_a_container_that_was_never_started_fails_at_once(
    lab_cluster: Lab, tmp_path: Path, deployments: list[Deployment]
) -> None:
    plan = lab_plan(lab_cluster, tmp_path / "recipes", "never-started", nodes=1)
    with pytest.raises(BootFailed) as caught:
        wait_until_ready(plan, gate_for(plan), timeout_s=FAULT_BOOT_S)
    error = caught.value
    assert (error.node, error.kind) == (plan.nodes[0].node, "container_missing")
    assert plan.nodes[0].container.name in error.cause
