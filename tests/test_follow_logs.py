"""Readiness over real SSH on the lab: Connection.stream_lines, then
sparkdeploy.steps.readiness_gate.follow_logs following engine stand-in containers on the lab
nodes (good boot, fatal lines on the head and on a worker, a SIGKILL from outside that is no OOM
kill, a missing container). The faults through the whole deploy are tests/test_fault_matrix_*.py;
a link dropped under a boot is tests/test_follow_logs_lab.py.

Without the lab (scripted streams in place of SSH): a log stream lost mid-boot is resumed where
it stopped, and a node that stays unreachable fails the boot naming the lost link."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
from readiness_lab import Deployment, lab_plan

from lab.cluster import Lab
from sparkdeploy.errors import BootFailed, RemoteError, TransientRemoteError
from sparkdeploy.remote.runner import StreamEnd
from sparkdeploy.remote.ssh import Connection, SshTarget, cached_connection
from sparkdeploy.remote.targets import node_target
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import Plan, make_plan
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.steps.readiness_gate import follow_logs, gate_for, wait_until_ready

lab = pytest.mark.lab

GOOD_BOOT_S = 90.0
# A fault shows within seconds; the timeout only bounds a test that went wrong.
FAULT_BOOT_S = 60.0
PROCESS_GONE_S = 5.0


@pytest.fixture
def node1(lab_cluster: Lab) -> Connection:
    return cached_connection(lab_cluster.ssh_target(lab_cluster.nodes[0]))


@lab
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


@lab
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


@lab
def test_stream_lines_ends_at_its_timeout_and_when_idle(node1: Connection) -> None:
    timed = node1.stream_lines(["sh", "-c", "while sleep 0.1; do echo tick; done"], timeout=1)
    assert set(timed) <= {b"tick"}
    assert (timed.ended, timed.exit_code) == ("timeout", None)
    idle = node1.stream_lines(["sh", "-c", "echo once; sleep 5"], timeout=30, idle_timeout=0.5)
    assert list(idle) == [b"once"]
    assert (idle.ended, idle.exit_code) == ("idle", None)


# -- readiness of stand-in containers ----------------------------------------------------------


def deploy(
    lab: Lab, tmp_path: Path, started: list[Deployment], *, nodes: int, fault: str = ""
) -> Deployment:
    name = f"ready-{secrets.token_hex(3)}"
    deployment = Deployment(lab_plan(lab, tmp_path / "recipes", name, nodes=nodes, fault=fault))
    started.append(deployment)
    deployment.start()
    return deployment


@lab
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
    assert result.figures["kv_cache_tokens"] > 0
    assert result.figures["max_concurrency"] > 0
    assert gate.timeline == result.timeline


@lab
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
    assert quoted in error.cause
    assert any(quoted in line for line in error.excerpt)
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


@lab
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


@lab
def test_a_container_that_was_never_started_fails_at_once(
    lab_cluster: Lab, tmp_path: Path, deployments: list[Deployment]
) -> None:
    plan = lab_plan(lab_cluster, tmp_path / "recipes", "never-started", nodes=1)
    with pytest.raises(BootFailed) as caught:
        wait_until_ready(plan, gate_for(plan), timeout_s=FAULT_BOOT_S)
    error = caught.value
    assert (error.node, error.kind) == (plan.nodes[0].node, "container_missing")
    assert plan.nodes[0].container.name in error.cause


# -- a lost log stream, without the lab ----------------------------------------------------------

EXAMPLE_CLUSTER = Path(__file__).parent.parent / "clusters" / "dgx-spark-4.toml"
T1 = "2025-10-20T08:12:01.000000001Z"
T2 = "2025-10-20T08:12:40.500000000Z"
T3 = "2025-10-20T08:13:02.000000000Z"
BEFORE_THE_LOSS = [
    f"{T1} (APIServer pid=1) INFO 10-20 08:12:01 [api_server.py:1839] vLLM API server version",
    # two lines at one instant: docker's --since gives both again, neither may be fed twice
    f"{T2} (EngineCore_DP0 pid=291) INFO 10-20 08:12:40 [default_loader.py:267] "
    "Loading weights took 21.27 seconds",
    f"{T2} (EngineCore_DP0 pid=291) INFO 10-20 08:12:40 [core.py:90] same instant",
]
AFTER_THE_LOSS = [
    f"{T2} (EngineCore_DP0 pid=291) INFO 10-20 08:12:40 [core.py:91] third line of that instant",
    f"{T3} (EngineCore_DP0 pid=291) ERROR 10-20 08:13:02 [core.py:708] "
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
]
GATE_TIMEOUT_S = 30.0


class ScriptedStream:
    """What follow_logs reads of a LineStream: scripted lines (docker's timestamps on them),
    then its end: "lost", or a live log that ends only when stopped."""

    def __init__(self, lines: list[str], end: StreamEnd) -> None:
        self.lines = lines
        self.end = end
        self.ended: StreamEnd | None = None
        self.exit_code: int | None = None
        self.argv: list[str] = []
        self.stop = threading.Event()

    def __iter__(self) -> Iterator[bytes]:
        for line in self.lines:
            yield line.encode()
        if self.end == "stopped":
            self.stop.wait()
        self.ended = self.end

    def close(self) -> None:
        self.stop.set()


class ScriptedNode:
    """A connection factory for one node: each connect takes the next step of the script, a
    stream its connection hands out or the RemoteError the connect fails with (the last step
    repeats)."""

    def __init__(self, *script: ScriptedStream | RemoteError) -> None:
        self.script = list(script)
        self.streams: list[ScriptedStream] = []

    def __call__(self, target: SshTarget) -> Connection:
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(step, RemoteError):
            raise step
        return cast(Connection, _ScriptedConnection(self, step))


@dataclass
class _ScriptedConnection:
    node: ScriptedNode
    stream: ScriptedStream

    def stream_lines(
        self, argv: Sequence[str], *, timeout: float, stop: threading.Event
    ) -> ScriptedStream:
        self.stream.argv = list(argv)
        self.stream.stop = stop  # a live log ends when the follower is stopped
        self.node.streams.append(self.stream)
        return self.stream

    def close(self) -> None:
        pass


def one_node_plan(tmp_path: Path) -> Plan:
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(
        'engine = "vllm"\nname = "lost link"\ndocker_image = "lab/vllm-standin:latest"\n'
        'model = "lab/tiny"\nrequired_nodes = 1\ntensor_parallel_size = 1\n'
    )
    return make_plan(load_recipe(recipe), load_cluster(EXAMPLE_CLUSTER))


def test_a_stream_lost_mid_boot_is_resumed_since_its_last_line_and_no_line_is_fed_twice(
    tmp_path: Path,
) -> None:
    plan = one_node_plan(tmp_path)
    node = ScriptedNode(
        ScriptedStream(BEFORE_THE_LOSS, "lost"),
        ScriptedStream([*BEFORE_THE_LOSS[1:], *AFTER_THE_LOSS], "stopped"),
    )
    gate = gate_for(plan)
    with pytest.raises(BootFailed) as caught:
        wait_until_ready(plan, gate, timeout_s=GATE_TIMEOUT_S, connection_for=node)
    # the fatal line after the loss is seen, not the gate's timeout
    assert (caught.value.node, caught.value.kind) == (plan.head.node, "cuda_out_of_memory")
    first, resumed = node.streams
    assert "--since" not in first.argv
    assert "--timestamps" in first.argv
    assert resumed.argv[resumed.argv.index("--since") + 1] == T2
    fed = [line.split(" ", 1)[1] for line in [*BEFORE_THE_LOSS, *AFTER_THE_LOSS]]
    assert gate.watch.lines(plan.head.node) == fed  # docker's timestamps stripped, none twice
    assert [entry.marker for entry in gate.timeline] == ["weights_loaded"]


def test_a_node_that_stays_unreachable_fails_naming_the_lost_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(follow_logs, "RECONNECT_WINDOW_S", 1.0)
    plan = one_node_plan(tmp_path)
    head = plan.head.node
    refused = TransientRemoteError(f"root@{head}:22: cannot connect: timed out")
    node = ScriptedNode(ScriptedStream(BEFORE_THE_LOSS, "lost"), refused)
    started = time.monotonic()
    with pytest.raises(BootFailed) as caught:
        wait_until_ready(plan, gate_for(plan), timeout_s=GATE_TIMEOUT_S, connection_for=node)
    error = caught.value
    assert time.monotonic() - started < GATE_TIMEOUT_S / 2, "it waited out the gate's timeout"
    assert (error.node, error.kind) == (head, "link_lost")
    assert f"lost the SSH link to {head}" in error.cause
    assert "could not reconnect" in error.cause
    assert str(refused) in error.cause


def test_the_timeout_while_a_link_is_down_names_the_link_not_the_markers(tmp_path: Path) -> None:
    plan = one_node_plan(tmp_path)
    head = plan.head.node
    refused = TransientRemoteError(f"root@{head}:22: cannot connect: timed out")
    node = ScriptedNode(ScriptedStream(BEFORE_THE_LOSS, "lost"), refused)
    with pytest.raises(BootFailed) as caught:
        wait_until_ready(plan, gate_for(plan), timeout_s=1.5, connection_for=node)
    error = caught.value
    assert (error.node, error.kind) == (head, "link_lost")
    assert "not back within the timeout of 1.5 s" in error.cause
    assert str(refused) in error.cause
