"""The fault matrix (issue 12): every fault through the real pipeline on the lab.

Each test breaks one thing (a node's sshd or dockerd, the registry, the hub, the NAS, a node's
disk, the staging copy, the engine, the Prefect worker, the lab itself), runs the deploy flow
(or the watchdog) against it and asserts:

- the run fails, or recovers where retrying is right, and the step that saw the fault names it
  within a stated bound of the evidence (the BOUND_* constants, each with its reason): the
  step is the failed task run, and its message names the node and the cause;
- nothing of the deployment is left on any node (no container of it, no process an SSH session
  started, such as a staging copy or a `docker pull`), and every node lock is free;
- no partial file is reported or reused as complete;
- a re-run after the fault is cleared deploys.

The detection time of each fault (evidence -> the step's failure, or its first failed attempt
where it recovers) is measured and written as a table to <lab root>/fault-matrix-<lab>.md and
to the end of the pytest output. README.md quotes it. The bounds are generous on purpose: CI
runs on two shared cores; a test never asserts the measured time itself.

The tasks' retry delays (10 s to 300 s in the field) are shortened to RETRY_DELAY_S here; the
table says what they add in the field. Faults that only real vLLM shows are in
tests/test_real_engine.py, named in FATAL_KINDS_OF_THE_REAL_ENGINE.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from lab_flows import (
    FAULT_MATRIX_TABLE,
    ask,
    flow_process,
    harness_env,
    nothing_runs,
    recipe_variant,
    register_lab_deployments,
    settled_task_runs,
    wait_for_state,
)

from flows.deploy import deploy
from flows.smoke import smoke
from flows.teardown import teardown
from lab.cluster import Lab
from lab.engine.standin_faults import MARKER_NAMED_KINDS
from lab.image import build_engine_image
from lab.models import TINY_CHAT, TINY_DSV41, publish_lab_models
from lab.prefect_local import (
    PROJECT_ROOT,
    deploy_run,
    deployment_run,
    run_prefect,
    start_worker,
    stop_worker,
)
from lab.tinymodel import EngramSpec, generate_repo
from sparkdeploy.errors import BootFailed, DeploymentDown, SmokeFailed
from sparkdeploy.remote.ssh import cached_connection, close_cached
from sparkdeploy.remote.targets import cluster_targets
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import lab_root, load_plan
from sparkdeploy.steps.hold_nodes import holders, release_nodes
from sparkdeploy.steps.status import cluster_status
from sparkdeploy.steps.teardown import teardown as remove_deployment

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]

SINGLE = PROJECT_ROOT / "recipes" / "lab-single" / "recipe.toml"
DSV41 = PROJECT_ROOT / "recipes" / "lab-dsv41-3x" / "recipe.toml"

# Every retried task waits this long between attempts here (field: tasks/*.py's schedules).
RETRY_DELAY_S = 1.0
# A failure the pipeline sees at once (a refused connection, a fatal log line, an exit, a
# full disk): the step that meets it fails within seconds; the rest is a loaded CI machine.
BOUND_AT_ONCE_S = 15.0
# A failure a step retries: every attempt fails the same way within seconds, RETRY_DELAY_S
# apart; three attempts of SSH connects with their own backoff.
BOUND_AFTER_RETRIES_S = 45.0
# What a Prefect process worker does before a hook of the deploy runs: it notices a
# cancellation at its next poll (seconds), sends SIGTERM and waits for the flow's process to
# end, then loads the flow from its deployment (a Python import of the project, seconds on two
# busy cores) to run the hook.
BOUND_WORKER_S = 60.0
# How long a process an SSH session started may outlive its session (it notices at its next
# write); the staging copy writes a progress line at least every chunk.
PROCESS_GONE_S = 15.0
DOCKER_S = 60.0
# How long the smoke test waits for an answer here (the hung long prompt waits this long).
SMOKE_REQUEST_TIMEOUT_S = 5.0


# -- the measured table ----------------------------------------------------------------------


@dataclass
class Measured:
    fault: str
    detected_by: str
    seconds: float | None  # None: nothing to detect (the pipeline carries on by itself)
    bound_s: float
    outcome: str
    field_note: str = ""

    @property
    def seconds_text(self) -> str:
        return "-" if self.seconds is None else f"{self.seconds:.1f} s"


@dataclass
class Matrix:
    rows: list[Measured] = field(default_factory=list)

    def record(
        self,
        fault: str,
        detected_by: str,
        seconds: float | None,
        bound_s: float,
        *,
        outcome: str = "failed",
        field_note: str = "",
    ) -> None:
        assert seconds is None or seconds <= bound_s, (
            f"{fault}: detected {seconds:.1f} s after the evidence, beyond the bound of"
            f" {bound_s:.0f} s"
        )
        self.rows.append(Measured(fault, detected_by, seconds, bound_s, outcome, field_note))

    def table(self) -> str:
        lines = [
            "| fault | detected by | evidence -> named | bound | outcome | in the field |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {row.fault} | {row.detected_by} | {row.seconds_text} | {row.bound_s:.0f} s |"
            f" {row.outcome} | {row.field_note} |"
            for row in self.rows
        ]
        return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def matrix(lab_cluster: Lab, request: pytest.FixtureRequest) -> Iterator[Matrix]:
    measured = Matrix()
    yield measured
    if measured.rows:
        path = lab_root() / f"fault-matrix-{lab_cluster.name}.md"
        path.write_text(measured.table())
        request.config.stash[FAULT_MATRIX_TABLE] = (str(path), measured.table())


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def short_retry_delays(monkeypatch: pytest.MonkeyPatch) -> None:
    """The retried tasks wait RETRY_DELAY_S between attempts, not their field schedules."""
    from tasks.compose_model import compose_models_on_nodes
    from tasks.hold_nodes import hold_nodes
    from tasks.image import ensure_images
    from tasks.prefetch import prefetch_repos
    from tasks.running_copy import check_running_copy
    from tasks.stage_engram import stage_engram_on_nodes
    from tasks.teardown import teardown_deployment
    from tasks.watchdog import report_health

    for retried in (
        hold_nodes,
        ensure_images,
        stage_engram_on_nodes,
        compose_models_on_nodes,
        prefetch_repos,
        check_running_copy,
        teardown_deployment,
        report_health,
    ):
        monkeypatch.setattr(retried, "retry_delay_seconds", [RETRY_DELAY_S] * retried.retries)


@pytest.fixture(autouse=True)
def clean_lab_after(lab_cluster: Lab, cluster: str) -> Iterator[None]:
    """Whatever a test left (it asserts there is nothing; a failed test may have stopped short
    of its own teardown) is removed after it, so one failure does not cascade."""
    yield
    close_cached()
    inventory = load_cluster(Path(cluster))
    held = {h.deployment_id for h in holders(inventory.name, lab_cluster.nodes).values() if h}
    running = {status.deployment_id for status in cluster_status(inventory)}
    for deployment_id in held | running:
        remove_deployment(deployment_id, cluster_targets(inventory), inventory.nas.runs_dir)
        release_nodes(inventory.name, lab_cluster.nodes, deployment_id)


# -- running a flow and reading what it said -------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """A task run's failed attempt: the step, its message, when Prefect recorded it."""

    task_run: str
    message: str
    at: float  # wall clock, seconds since the epoch
    final: bool  # Failed (not AwaitingRetry)


@dataclass
class Run:
    state: Any
    started_at: float
    ended_at: float
    attempts: list[Attempt]
    logs: list[tuple[str, float]]  # every log line of the run and its task runs, with its time

    @property
    def failed(self) -> bool:
        return bool(self.state.is_failed())

    @property
    def error(self) -> BaseException:
        error = self.state.result(raise_on_failure=False)
        assert isinstance(error, BaseException), f"the run did not fail: {self.state}"
        return error

    def named(self, step: str, *, node: str, cause: str) -> Attempt:
        """The step's first failed attempt, which must name the node (or, for a step on the
        flow's host, what it failed on) and the cause (a regex); the flow's own failure, if
        it failed, must name both too."""
        # A task run is named after its task: "image-1a2" or "readiness-gate <deployment>".
        named = re.compile(rf"{re.escape(step)}(-[0-9a-f]+| .+)")
        of_step = [a for a in self.attempts if named.fullmatch(a.task_run)]
        assert of_step, f"no failed attempt of {step}; failed: {self.attempts}"
        first = of_step[0]
        assert node in first.message, f"{step} does not name {node}: {first.message}"
        assert re.search(cause, first.message), f"{step} does not say {cause!r}: {first.message}"
        if self.failed:
            message = str(self.state.message)
            assert node in message and re.search(cause, message), message
        return first


RETRIED_ATTEMPT = "Task run failed with exception: "


def _wall(timestamp: datetime) -> float:
    return timestamp.timestamp()


def run_flow(flow: Any, *args: Any, **kwargs: Any) -> Run:
    """The flow run to its end (failed or not), with every failed attempt of its task runs: a
    Failed state, or an attempt that Prefect retries (its AwaitingRetry state carries no
    message; the log line "Task run failed with exception: ... - Retry 1/2 will start" does)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.logging.handlers import APILogHandler

    started = time.time()
    state = flow(*args, return_state=True, **kwargs)
    ended = time.time()
    APILogHandler().flush()
    flow_run_id = state.state_details.flow_run_id
    attempts = []
    with get_client(sync_client=True) as client:
        names = {}
        for task_run in settled_task_runs(flow_run_id):
            names[task_run.id] = task_run.name
            attempts += [
                Attempt(task_run.name, past.message or "", _wall(past.timestamp), final=True)
                for past in client.read_task_run_states(task_run.id)
                if past.is_failed()
            ]
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    attempts += [
        Attempt(
            names.get(log.task_run_id, "?") if log.task_run_id else "flow",
            log.message.removeprefix(RETRIED_ATTEMPT),
            _wall(log.timestamp),
            final=False,
        )
        for log in logs
        if log.message.startswith(RETRIED_ATTEMPT) and log.message.endswith("from now")
    ]
    lines = sorted(((log.message, _wall(log.timestamp)) for log in logs), key=lambda m: m[1])
    return Run(state, started, ended, sorted(attempts, key=lambda a: a.at), lines)


def deploys(recipe: str, cluster: str, **kwargs: Any) -> Run:
    """A deploy that must succeed (a re-run after the fault is cleared); torn down after."""
    run = run_flow(deploy, recipe, cluster=cluster, **kwargs)
    assert run.state.is_completed(), run.state.message
    return run


# -- what is left ----------------------------------------------------------------------------

# A node's own daemons; every other process there is a container's or an SSH session's.
NODE_DAEMONS = frozenset({"sshd", "sshd-session", "dockerd", "containerd"})


def _node_processes(lab: Lab, node: str) -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, command name, command line) of every process in the node."""
    listed = subprocess.run(
        ["ip", "netns", "pids", lab.layout.node_netns(node)],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    found = {}
    for pid in map(int, listed.stdout.split()):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError):
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        state, parent = stat.rsplit(")", 1)[1].split()[:2]
        if state not in ("Z", "X"):
            found[pid] = (int(parent), name, cmdline.strip())
    return found


def session_leftovers(lab: Lab) -> list[str]:
    """Processes on the nodes that are neither a node daemon nor in a container: what an SSH
    session started and left (a staging copy, a `docker pull`, a `docker logs -f`)."""
    leftovers = []
    for node in lab.nodes:
        processes = _node_processes(lab, node)

        def in_container(pid: int, processes: dict[int, tuple[int, str, str]] = processes) -> bool:
            while pid in processes:
                parent, name, _ = processes[pid]
                if name.startswith("containerd-shim"):
                    return True
                pid = parent
            return False

        leftovers += [
            f"{node}: {pid} {cmdline[:160]}"
            for pid, (_, name, cmdline) in processes.items()
            if name not in NODE_DAEMONS
            and not name.startswith("containerd-shim")
            and not in_container(pid)
        ]
    return leftovers


def nothing_left(lab: Lab, cluster: str) -> None:
    """No container of ours, no node held, no process an SSH session left on any node."""
    nothing_runs(cluster)
    deadline = time.monotonic() + PROCESS_GONE_S
    while (leftovers := session_leftovers(lab)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers, leftovers


def on_node(lab: Lab, node: str, *argv: str, check: bool = True) -> str:
    result = cached_connection(lab.ssh_target(node)).run(list(argv), timeout=DOCKER_S, check=check)
    return result.stdout.decode()


# -- node daemons ----------------------------------------------------------------------------


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
            if any(pulling in cmd for _, _, cmd in _node_processes(lab_cluster, "node1").values()):
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


# -- the hub and the NAS ---------------------------------------------------------------------

FAULT_CHAT = "lab/fault-chat"
CUT_AFTER_BYTES = 10


@pytest.fixture(scope="module")
def fault_chat(lab_cluster: Lab, tmp_path_factory: pytest.TempPathFactory) -> str:
    """lab-single serving its own copy of the tiny chat model, which each hub test removes from
    the NAS first, so the prefetch fetches it."""
    generate_repo(
        lab_cluster.hub_repos_dir,
        FAULT_CHAT,
        num_shards=TINY_CHAT.num_shards,
        total_bytes=TINY_CHAT.total_bytes,
    )
    return recipe_variant(
        tmp_path_factory.mktemp("recipes"),
        "lab-fault-chat",
        SINGLE,
        ('model = "lab/tiny-chat"', f'model = "{FAULT_CHAT}"'),
    )


def nas_repo(cluster: str, repo: str) -> Path:
    return Path(load_cluster(Path(cluster)).nas.hf_cache) / ("models--" + repo.replace("/", "--"))


def hub_faults(lab: Lab, **switches: Any) -> None:
    """POST /_lab/faults on the lab hub (lab/hub.py): fail_next + status, cut_next_file, reset."""
    request = urllib.request.Request(
        f"{lab.hub_url}/_lab/faults",
        data=json.dumps(switches).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200


def assert_nas_repo_complete_or_absent(lab: Lab, cluster: str, repo: str) -> None:
    """Every file the NAS snapshot links is the hub's file, byte for byte; a partial download
    (*.incomplete) is never linked. Without a manifest, nothing may claim the repo complete."""
    storage = nas_repo(cluster, repo)
    source = lab.hub_repos_dir / repo
    for snapshot in (storage / "snapshots").glob("*"):
        for entry in snapshot.rglob("*"):
            if entry.is_symlink() or entry.is_file():
                target = entry.resolve()
                assert not target.name.endswith(".incomplete"), f"{entry} links a partial"
                relative = entry.relative_to(snapshot)
                assert target.read_bytes() == (source / relative).read_bytes(), entry


def test_hub_503s_are_retried_and_the_deploy_recovers(
    cluster: str, lab_cluster: Lab, fault_chat: str, matrix: Matrix
) -> None:
    subprocess.run(["rm", "-rf", str(nas_repo(cluster, FAULT_CHAT))], check=True)
    failing_at = time.time()
    hub_faults(lab_cluster, fail_next=2, status=503)
    try:
        run = run_flow(deploy, fault_chat, cluster=cluster, skip=["smoke-test"])
    finally:
        hub_faults(lab_cluster, reset=True)
    assert run.state.is_completed(), run.state.message
    attempt = run.named("prefetch", node=lab_cluster.hub_url, cause="503")
    assert not attempt.final
    assert_nas_repo_complete_or_absent(lab_cluster, cluster, FAULT_CHAT)
    matrix.record(
        "hub answers 503",
        "prefetch: the hub's 5xx is transient; the task retries",
        attempt.at - failing_at,
        BOUND_AT_ONCE_S,
        outcome="recovered",
        field_note="the prefetch retries wait 10, 60, 300 s",
    )
    teardown(fault_chat, cluster=cluster)
    nothing_left(lab_cluster, cluster)


def prefetch_said(run: Run, pattern: str) -> float:
    """When the prefetch task logged a line matching pattern (what it recovered from inside)."""
    said = [at for message, at in run.logs if re.search(pattern, message)]
    assert said, f"the prefetch never said {pattern!r}"
    return said[0]


def test_a_hub_cutting_a_file_mid_way_is_resumed_from_the_byte_it_reached(
    cluster: str, lab_cluster: Lab, fault_chat: str, matrix: Matrix
) -> None:
    subprocess.run(["rm", "-rf", str(nas_repo(cluster, FAULT_CHAT))], check=True)
    cut_at = time.time()
    # Whichever file goes first is cut (the smallest is 50 bytes), so the test does not depend
    # on which of the parallel downloads the hub serves first.
    hub_faults(lab_cluster, cut_next_file=CUT_AFTER_BYTES)
    try:
        run = run_flow(deploy, fault_chat, cluster=cluster, skip=["smoke-test"])
    finally:
        hub_faults(lab_cluster, reset=True)
    assert run.state.is_completed(), run.state.message
    seen = prefetch_said(run, rf"retrying from byte {CUT_AFTER_BYTES} ")
    assert_nas_repo_complete_or_absent(lab_cluster, cluster, FAULT_CHAT)
    matrix.record(
        "hub cuts a file mid-way",
        "prefetch: the body ends short; the download resumes from that byte (Range)",
        seen - cut_at,
        BOUND_AT_ONCE_S,
        outcome="recovered inside the step",
    )
    teardown(fault_chat, cluster=cluster)
    nothing_left(lab_cluster, cluster)


@contextlib.contextmanager
def served_wrong(path: Path) -> Iterator[None]:
    """The hub serves other bytes for `path` under the digests it listed: the file changed in
    place with its size, inode and mtime kept (what the hub's digest cache keys on)."""
    original = path.read_bytes()
    stat = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(len(original) // 2)
        handle.write(bytes(255 - byte for byte in original[len(original) // 2 :][:4096]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    try:
        yield
    finally:
        path.write_bytes(original)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_hub_serving_wrong_bytes_fails_naming_the_file_and_nothing_corrupt_is_kept(
    cluster: str, lab_cluster: Lab, fault_chat: str, matrix: Matrix
) -> None:
    subprocess.run(["rm", "-rf", str(nas_repo(cluster, FAULT_CHAT))], check=True)
    shard = sorted((lab_cluster.hub_repos_dir / FAULT_CHAT).glob("*.safetensors"))[0]
    with served_wrong(shard):
        corrupt_at = time.time()
        run = run_flow(deploy, fault_chat, cluster=cluster, skip=["smoke-test"])
    assert run.failed
    attempt = run.named("prefetch", node=shard.name, cause="the hub's copy is corrupt")
    assert attempt.final  # a corrupt file is no transient failure: no retry
    assert_nas_repo_complete_or_absent(lab_cluster, cluster, FAULT_CHAT)
    assert not list(nas_repo(cluster, FAULT_CHAT).glob(".sparkdeploy/*.json")), "a manifest"
    nothing_left(lab_cluster, cluster)
    matrix.record(
        "hub serves wrong bytes",
        "prefetch: the sha256 differs from the hub's listing twice (fetched again once)",
        attempt.at - corrupt_at,
        BOUND_AT_ONCE_S,
    )


def test_the_nas_filling_up_during_the_prefetch_fails_naming_it(
    cluster: str, lab_cluster: Lab, fault_chat: str, matrix: Matrix
) -> None:
    """The repo's NAS directory on a 256 KiB tmpfs: room enough for the free-space check of
    the cache as a whole, not for the 1 MiB of the repo."""
    storage = nas_repo(cluster, FAULT_CHAT)
    subprocess.run(["rm", "-rf", str(storage)], check=True)
    storage.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(storage)], check=True)
    try:
        full_at = time.time()
        run = run_flow(deploy, fault_chat, cluster=cluster, skip=["smoke-test"])
        assert run.failed
        attempt = run.named("prefetch", node=str(storage), cause="No space left on device")
        assert_nas_repo_complete_or_absent(lab_cluster, cluster, FAULT_CHAT)
        assert not list(storage.glob(".sparkdeploy/*.json")), "a manifest of a partial repo"
    finally:
        subprocess.run(["umount", str(storage)], check=True)
    nothing_left(lab_cluster, cluster)
    matrix.record(
        "NAS full during the prefetch",
        "prefetch: a write fails with ENOSPC (not retried)",
        attempt.at - full_at,
        BOUND_AT_ONCE_S,
    )


def test_after_the_hub_and_nas_faults_the_recipe_deploys(
    cluster: str, lab_cluster: Lab, fault_chat: str
) -> None:
    """The re-run of the two faults above that failed (the hub's file restored, the NAS
    unmounted): the prefetch fetches what it lacks and verifies it all."""
    deploys(fault_chat, cluster, skip=["smoke-test"])
    assert_nas_repo_complete_or_absent(lab_cluster, cluster, FAULT_CHAT)
    assert list(nas_repo(cluster, FAULT_CHAT).glob(".sparkdeploy/*.json")), "no manifest"
    teardown(fault_chat, cluster=cluster)
    nothing_left(lab_cluster, cluster)


# -- staging on the nodes --------------------------------------------------------------------

FAULT_DSV41 = "lab/fault-dsv41"
# Engram tables of 48 MiB: a node's share of each is one 16 MiB copy chunk.
FAULT_TABLE_BYTES = 48 << 20
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
# The share of a CPU a slowed node's SSH sessions get: a staging copy then takes seconds.
SLOW_PERCENT = 3


@pytest.fixture(scope="module")
def fault_dsv41(lab_cluster: Lab, tmp_path_factory: pytest.TempPathFactory) -> str:
    """lab-dsv41-3x on a model whose Engram tables take a while to copy."""
    generate_repo(
        lab_cluster.hub_repos_dir,
        FAULT_DSV41,
        num_shards=TINY_DSV41.num_shards,
        total_bytes=TINY_DSV41.total_bytes,
        engram=EngramSpec.for_table_bytes(FAULT_TABLE_BYTES, n_heads=3),
        tp_size=TINY_DSV41.tp_size,
    )
    recipe = tmp_path_factory.mktemp("recipes") / "lab-fault-dsv41" / "recipe.toml"
    recipe.parent.mkdir()
    recipe.write_text(DSV41.read_text().replace("tiny-dsv41", "fault-dsv41"))
    return str(recipe.parent)


def staged_files(cluster: str, recipe: str, node: str) -> list[str]:
    plan_node = next(n for n in load_plan(recipe, cluster).nodes if n.node == node)
    return [stage.dest for stage in plan_node.engram]


def forget_staged(lab: Lab, cluster: str, recipe: str, node: str) -> list[str]:
    """The node's copies of the recipe's Engram shards removed, so the next deploy copies."""
    dests = staged_files(cluster, recipe, node)
    for dest in dests:
        on_node(
            lab,
            node,
            "rm",
            "-f",
            dest,
            f"{dest}.manifest.json",
            f"{dest}.partial",
            f"{dest}.partial.journal.json",
        )
    return dests


class SlowedSessions:
    """A node's SSH sessions (everything its sshd starts from now) get SLOW_PERCENT of a CPU, so
    a step there is caught mid-way: a cgroup under the node's own (which `lab down` removes).
    restore() moves every process back to full speed."""

    def __init__(self, lab: Lab, node: str) -> None:
        self.cgroup = CPU_CGROUP / lab.layout.cgroup_parent(node) / "slow-sessions"
        self.cgroup.mkdir(parents=True, exist_ok=True)
        (self.cgroup / "cpu.cfs_period_us").write_text("100000")
        (self.cgroup / "cpu.cfs_quota_us").write_text(str(SLOW_PERCENT * 1000))
        (self.cgroup / "cgroup.procs").write_text(str(lab.daemon_pid(f"{node}/sshd")))

    def restore(self) -> None:
        if not self.cgroup.exists():
            return
        for pid in (self.cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (CPU_CGROUP / "cgroup.procs").write_text(pid)
        self.cgroup.rmdir()


def wait_for(what: str, found: Callable[[], Any], timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := found()):
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.01)
    return result


def staging_process(lab: Lab, node: str) -> int | None:
    """The node's staging script (its request is the JSON with "stages" in its argv)."""
    for pid, (_, name, cmdline) in _node_processes(lab, node).items():
        if name.startswith("python") and '"stages"' in cmdline:
            return pid
    return None


@contextlib.contextmanager
def during_staging(
    lab: Lab, node: str, dests: list[str], fault: Callable[[int], None]
) -> Iterator[list[float]]:
    """fault(staging pid) once the node's staging copy has begun writing (its first .partial
    exists), with the copy paused meanwhile and back at full speed after; yields the list the
    fault's time goes into."""
    struck: list[float] = []
    errors: list[BaseException] = []
    slowed = SlowedSessions(lab, node)

    def strike() -> None:
        try:
            partials = [lab.node_path(node, f"{dest}.partial") for dest in dests]
            wait_for("the staging copy", lambda: any(p.exists() for p in partials))
            pid = wait_for("the staging process", lambda: staging_process(lab, node))
            os.kill(pid, signal.SIGSTOP)
            try:
                struck.append(time.time())
                fault(pid)
            finally:
                slowed.restore()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        except BaseException as error:
            errors.append(error)

    striker = threading.Thread(target=strike)
    striker.start()
    try:
        yield struck
    finally:
        striker.join()
        slowed.restore()
    if errors:
        raise errors[0]
    assert struck, "the fault never struck"


def stage_results(run: Run, node: str) -> set[str]:
    """The statuses (copied, resumed, skipped) the staging step logged for the node."""
    return {
        match.group(1)
        for message, _ in run.logs
        if (match := re.match(rf"node {node}: \S+: (copied|resumed|skipped), share", message))
    }


def test_sshd_killed_mid_staging_is_retried_on_a_new_connection_and_the_copy_resumes(
    cluster: str, lab_cluster: Lab, fault_dsv41: str, matrix: Matrix
) -> None:
    """node2's sshd and every session of it killed while its copy runs, then started again
    (as a service manager restarts it)."""
    dests = forget_staged(lab_cluster, cluster, fault_dsv41, "node2")

    def kill_sshd(_: int) -> None:
        lab_cluster.stop_daemon("node2/sshd")
        lab_cluster.start_daemon("node2/sshd")

    with during_staging(lab_cluster, "node2", dests, kill_sshd) as struck:
        run = run_flow(deploy, fault_dsv41, cluster=cluster, skip=["smoke-test"])
    assert run.state.is_completed(), run.state.message
    attempt = run.named("stage-engram", node="node2", cause="connection (was )?lost")
    assert not attempt.final
    assert stage_results(run, "node2") & {"copied", "resumed"}
    matrix.record(
        "sshd killed mid-staging",
        "stage-engram: the SSH channel closes without EOF; retried on a new connection",
        attempt.at - struck[0],
        BOUND_AT_ONCE_S,
        outcome="recovered: the retry resumed the copy",
        field_note="the retry waits 10 s",
    )
    teardown(fault_dsv41, cluster=cluster)
    nothing_left(lab_cluster, cluster)


def test_a_node_disk_filling_up_during_staging_fails_naming_it(
    cluster: str, lab_cluster: Lab, fault_dsv41: str, matrix: Matrix
) -> None:
    """node2's Engram dir on a tmpfs with room for the copy, filled while the copy runs."""
    dests = forget_staged(lab_cluster, cluster, fault_dsv41, "node2")
    engram_dir = str(Path(dests[0]).parent)
    in_node2 = ["nsenter", f"--target={lab_cluster.daemon_pid('node2/sshd')}", "--mount", "--"]
    on_node(lab_cluster, "node2", "mkdir", "-p", engram_dir)
    subprocess.run(
        [*in_node2, "mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", engram_dir], check=True
    )

    def fill(_: int) -> None:
        filler = lab_cluster.node_path("node2", f"{engram_dir}/filler")
        with open(filler, "wb") as handle, contextlib.suppress(OSError):
            while True:
                handle.write(b"\0" * (1 << 20))

    try:
        with during_staging(lab_cluster, "node2", dests, fill) as struck:
            run = run_flow(deploy, fault_dsv41, cluster=cluster, skip=["smoke-test"])
        assert run.failed
        attempt = run.named("stage-engram", node="node2", cause=r"\[no_space\].*disk filled up")
        for dest in dests:
            assert not lab_cluster.node_path("node2", dest).exists()
    finally:
        subprocess.run([*in_node2, "umount", engram_dir], check=True)
    nothing_left(lab_cluster, cluster)
    matrix.record(
        "node disk full during staging",
        "stage-engram: a write fails with ENOSPC, named no_space (not retried)",
        attempt.at - struck[0],
        BOUND_AT_ONCE_S,
    )


def test_a_killed_staging_copy_fails_naming_it_and_the_re_run_resumes_it(
    cluster: str, lab_cluster: Lab, fault_dsv41: str, matrix: Matrix
) -> None:
    """Then the re-run of this fault and of the full disk above: node2 copies its shards
    (resuming what the killed copy made durable)."""
    dests = forget_staged(lab_cluster, cluster, fault_dsv41, "node2")

    def kill(pid: int) -> None:
        os.kill(pid, signal.SIGKILL)

    with during_staging(lab_cluster, "node2", dests, kill) as struck:
        run = run_flow(deploy, fault_dsv41, cluster=cluster, skip=["smoke-test"])
    assert run.failed
    attempt = run.named("stage-engram", node="node2", cause="killed by a signal")
    assert attempt.final
    for dest in dests:  # the copy is left as a partial, never as the file
        assert not lab_cluster.node_path("node2", dest).exists()
    nothing_left(lab_cluster, cluster)
    matrix.record(
        "staging copy killed",
        "stage-engram: the script ends without its answer (not retried)",
        attempt.at - struck[0],
        BOUND_AT_ONCE_S,
    )
    rerun = deploys(fault_dsv41, cluster, skip=["smoke-test"])  # the re-run, after both faults
    assert stage_results(rerun, "node2") & {"copied", "resumed"}
    teardown(fault_dsv41, cluster=cluster)
    nothing_left(lab_cluster, cluster)


# -- the engine ------------------------------------------------------------------------------

TWO_NODES = (
    ("required_nodes = 1", "required_nodes = 2"),
    ("tensor_parallel_size = 1", "tensor_parallel_size = 2"),
)


def with_env(**env: str) -> tuple[str, str]:
    lines = "".join(f"{name} = {json.dumps(value)}\n" for name, value in env.items())
    return "[env]\n", f"[env]\n{lines}"


def _docker_time(stamp: str) -> float:
    """docker's RFC 3339 timestamp with nanoseconds, as seconds since the epoch."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{whole}.{(fraction + '000000')[:6]}+00:00").timestamp()


def logged_at(
    cluster: str,
    recipe: str,
    text: str | None,
    node: str | None = None,
    nodes: list[str] | None = None,
) -> float:
    """When a container of the deployment (on `node`, or on any) printed the line holding
    `text`, or its last line (its log, kept on the NAS by the teardown, has docker's
    timestamps)."""
    plan = load_plan(recipe, cluster, nodes)
    kept = Path(plan.runs_dir) / plan.deployment_id
    for plan_node in plan.nodes:
        if node not in (None, plan_node.node):
            continue
        lines = (kept / f"{plan_node.node}.log").read_text().splitlines()
        for line in reversed(lines) if text is None else lines:
            stamp, _, printed = line.partition(" ")
            if text is None or text in printed:
                return _docker_time(stamp)
    raise AssertionError(f"no container printed {text!r}; their logs are in {kept}")


def engine_failure(
    run: Run,
    cluster: str,
    recipe: str,
    *,
    node: str,
    kind: str,
    nodes: list[str] | None = None,
) -> float:
    """The readiness gate named the node and the kind, quoting the line; seconds from that
    line (or from the readiness timeout's end) to the gate's failure."""
    error = run.error
    assert isinstance(error, BootFailed), error
    assert (error.node, error.kind) == (node, kind), error
    attempt = run.named("readiness-gate", node=node, cause=re.escape(kind))
    if kind == "timeout":
        started = next(at for message, at in run.logs if message.startswith("following the"))
        return attempt.at - (started + load_plan(recipe, cluster, nodes).readiness_timeout_s)
    evidence = error.excerpt[-1]
    assert evidence[:80] in str(error), error
    return attempt.at - logged_at(cluster, recipe, evidence[-120:], nodes=nodes)


# Each of the gate's fatal line kinds (sparkdeploy/vllm_markers.py), as the stand-in prints
# it: STANDIN_FAULT, then the kind the gate names.
FATAL_KINDS = {
    "fatal:free_memory": "free_memory_below_utilization",
    "fatal:kv_cache_needed": "kv_cache_too_small_for_max_len",
    "fatal:no_cache_blocks": "no_kv_cache_memory",
    "fatal:cuda_oom": "cuda_out_of_memory",
    "fatal:dist_network": "distributed_connect_timeout",
    "fatal:engine_timeout": "engine_ready_timeout",
    "fatal:engine_core_failed": "engine_core_init_failed",
    "crash": "engine_core_init_failed",
    "exit137": "killed",
    **{f"fatal:{kind}": kind for kind in MARKER_NAMED_KINDS},
}
# The kinds a recipe's own mistake makes the stand-in print: recipe lines replaced, the kind.
RECIPE_KINDS = {
    "unrecognized_arguments": ('"--max-model-len", "4096",', '"--bogus-flag", "1",'),
    # A value the recipe's own checks leave to vLLM (--max-model-len lots is refused at plan).
    "bad_command_line": ('"--max-model-len", "4096",', '"--max-model-len", "4096", "--seed", "x",'),
}
# The kinds only real vLLM prints, and where they are seen.
FATAL_KINDS_OF_THE_REAL_ENGINE = {
    "max_model_len_too_long": "tests/test_real_engine.py::test_a_real_start_up_failure_is_named",
    "model_path_invalid": "tests/test_vllm_logs.py (real vLLM 0.32's log of it, fed to the gate)",
}


def test_the_matrix_has_every_fatal_line_kind_of_the_gate() -> None:
    from sparkdeploy.vllm.markers import DEFAULT_FAILURE_MARKERS

    covered = {
        *FATAL_KINDS.values(),
        *RECIPE_KINDS,
        "model_not_in_offline_cache",
        *FATAL_KINDS_OF_THE_REAL_ENGINE,
    }
    assert {marker.name for marker in DEFAULT_FAILURE_MARKERS} <= covered


@dataclass(frozen=True)
class FatalCase:
    label: str
    recipe: str
    kind: str
    skip: tuple[str, ...] = ("smoke-test",)


def fatal_cases(tmp_path: Path) -> list[FatalCase]:
    """A lab-single variant per fatal line kind the stand-in or a recipe mistake shows."""
    cases = [
        FatalCase(
            f"{kind} ({fault})",
            recipe_variant(tmp_path, f"lab-fatal-{index}", SINGLE, with_env(STANDIN_FAULT=fault)),
            kind,
        )
        for index, (fault, kind) in enumerate(sorted(FATAL_KINDS.items()))
    ]
    cases += [
        FatalCase(f"{kind} (recipe)", recipe_variant(tmp_path, f"lab-{kind}", SINGLE, line), kind)
        for kind, line in sorted(RECIPE_KINDS.items())
    ]
    missing = ('model = "lab/tiny-chat"', 'model = "lab/nowhere"')
    cases.append(
        FatalCase(
            "model_not_in_offline_cache (not prefetched)",
            recipe_variant(tmp_path, "lab-no-model", SINGLE, missing),
            "model_not_in_offline_cache",
            # The fit step reads the model's config first and says "run the prefetch step".
            ("prefetch", "fit", "smoke-test"),
        )
    )
    return cases


def test_each_fatal_line_kind_fails_the_boot_naming_node_and_kind(
    cluster: str, lab_cluster: Lab, tmp_path: Path, matrix: Matrix
) -> None:
    """Every kind once, in three lanes at a time (a lane per node, one deploy after another),
    as a deploy of one node each."""
    cases = fatal_cases(tmp_path)
    outcomes: dict[str, float | BaseException] = {}

    def lane(node: str, share: list[FatalCase]) -> None:
        for case in share:
            try:
                run = run_flow(deploy, case.recipe, cluster=cluster, nodes=[node], skip=case.skip)
                assert run.failed, f"{case.label} deployed"
                outcomes[case.label] = engine_failure(
                    run, cluster, case.recipe, node=node, kind=case.kind, nodes=[node]
                )
            except Exception as error:
                outcomes[case.label] = error

    lanes = [
        threading.Thread(target=lane, args=(node, cases[index :: len(lab_cluster.nodes)]))
        for index, node in enumerate(lab_cluster.nodes)
    ]
    for started in lanes:
        started.start()
    for started in lanes:
        started.join()
    failed = {label: error for label, error in outcomes.items() if isinstance(error, Exception)}
    assert not failed, failed
    assert len(outcomes) == len(cases)
    nothing_left(lab_cluster, cluster)
    for case in cases:
        seconds = outcomes[case.label]
        assert isinstance(seconds, float)
        matrix.record(f"fatal line: {case.label}", "readiness-gate", seconds, BOUND_AT_ONCE_S)


def worker_named(run: Run, lab: Lab, cluster: str, recipe: str) -> tuple[str, float]:
    """A two-node boot that failed on its worker, node2, named so; its kind and the seconds
    from the evidence. Nothing may be left of it."""
    assert run.failed
    error = run.error
    assert isinstance(error, BootFailed) and error.node == "node2", error
    seconds = engine_failure(run, cluster, recipe, node="node2", kind=error.kind)
    nothing_left(lab, cluster)
    return error.kind, seconds


def test_an_engine_crash_on_one_rank_is_named_on_its_node(
    cluster: str, lab_cluster: Lab, tmp_path: Path, matrix: Matrix
) -> None:
    recipe = recipe_variant(
        tmp_path, "lab-two-crash", SINGLE, *TWO_NODES, with_env(STANDIN_FAULT="crash@1")
    )
    run = run_flow(deploy, recipe, cluster=cluster, skip=["smoke-test"])
    kind, seconds = worker_named(run, lab_cluster, cluster, recipe)
    matrix.record(f"engine crash on one rank ({kind})", "readiness-gate", seconds, BOUND_AT_ONCE_S)


def test_a_real_oom_kill_is_named_from_dockers_state(
    cluster: str, lab_cluster: Lab, tmp_path: Path, matrix: Matrix
) -> None:
    """The kernel enforces a container memory limit (an inventory whose docker.run_options cap
    the memory) on an engine that allocates past it."""
    capped = lab_cluster.inventory_path.with_name("cluster-memory-capped.toml")
    capped.write_text(
        lab_cluster.inventory_path.read_text().replace(
            "run_options = [", 'run_options = ["--memory", "128m", "--memory-swap", "128m", ', 1
        )
    )
    recipe = recipe_variant(tmp_path, "lab-oom", SINGLE, with_env(STANDIN_FAULT="allocate:512"))
    run = run_flow(deploy, recipe, cluster=str(capped), skip=["smoke-test"])
    assert run.failed
    error = run.error
    assert isinstance(error, BootFailed), error
    assert (error.node, error.kind) == ("node1", "oom_killed"), error
    assert "State.OOMKilled is true" in error.cause
    attempt = run.named("readiness-gate", node="node1", cause="oom_killed")
    last_line = logged_at(str(capped), recipe, None, "node1")  # just before the kill
    nothing_left(lab_cluster, cluster)
    matrix.record(
        "real OOM kill (cgroup memory limit)",
        "readiness-gate: the container exits 137, docker's State.OOMKilled is true",
        attempt.at - last_line,
        BOUND_AT_ONCE_S,
    )


def test_a_hang_fails_on_the_readiness_timeout(
    cluster: str, lab_cluster: Lab, tmp_path: Path, matrix: Matrix
) -> None:
    recipe = recipe_variant(
        tmp_path,
        "lab-hang",
        SINGLE,
        with_env(STANDIN_FAULT="hang"),
        ('VLLM_ENGINE_READY_TIMEOUT_S = "60"', 'VLLM_ENGINE_READY_TIMEOUT_S = "5"'),
    )
    run = run_flow(deploy, recipe, cluster=cluster)
    assert run.failed
    seconds = engine_failure(run, cluster, recipe, node="node1", kind="timeout")
    nothing_left(lab_cluster, cluster)
    matrix.record(
        "engine hangs (never ready)",
        "readiness-gate: its timeout, naming the marker it waited for",
        seconds,
        BOUND_AT_ONCE_S,
        field_note="the recipe's VLLM_ENGINE_READY_TIMEOUT_S (5 s here, 600 s by default)",
    )


def test_a_worker_that_never_joins_is_named(
    cluster: str, lab_cluster: Lab, tmp_path: Path, matrix: Matrix
) -> None:
    """node2 cannot reach node1 over the fabric (a route in node2's namespace).
    Real vLLM's case: tests/test_real_engine.py::test_a_worker_that_never_joins_is_named."""
    recipe = recipe_variant(
        tmp_path,
        "lab-two-apart",
        SINGLE,
        *TWO_NODES,
        with_env(VLLM_RENDEZVOUS_TIMEOUT_S="5"),
    )
    # node1 by way of a gateway that is not there: node2's packets to it go nowhere, as on a
    # fabric whose switch drops them (a blackhole route would refuse at once).
    nowhere = lab_cluster.node_ip("node1").rsplit(".", 1)[0] + ".250"
    route = [f"{lab_cluster.node_ip('node1')}/32", "via", nowhere]
    in_node2 = ["ip", "netns", "exec", lab_cluster.layout.node_netns("node2"), "ip", "route"]
    subprocess.run([*in_node2, "add", *route], check=True, timeout=10)
    try:
        run = run_flow(deploy, recipe, cluster=cluster, skip=["smoke-test"])
    finally:
        subprocess.run([*in_node2, "del", *route], check=True, timeout=10)
    kind, seconds = worker_named(run, lab_cluster, cluster, recipe)
    matrix.record(
        f"a worker never joins ({kind})",
        "readiness-gate: the worker's rendezvous timeout (VLLM_RENDEZVOUS_TIMEOUT_S, 5 s here)",
        seconds,
        BOUND_AT_ONCE_S,
    )


def test_a_worker_dead_after_ready_is_named_by_the_watchdog(
    cluster: str, lab_cluster: Lab, matrix: Matrix
) -> None:
    """The watchdog re-plans what runs from the recipes it knows, so a recipe of the repo.
    Real vLLM's case: tests/test_real_engine.py::test_two_nodes_deploy_through_prefect_and_
    a_killed_worker_is_named."""
    deploys("lab-dsv41-3x", cluster, skip=["smoke-test"])
    worker = load_plan("lab-dsv41-3x", cluster).nodes[1]
    on_node(lab_cluster, "node2", "docker", "kill", worker.container.name)
    killed_at = time.time()
    run = run_flow(smoke, cluster=cluster)
    assert run.failed
    error = run.error
    assert isinstance(error, DeploymentDown) and error.node == "node2", error
    attempt = run.named("watchdog-health", node="node2", cause=error.kind)
    teardown("lab-dsv41-3x", cluster=cluster)
    nothing_left(lab_cluster, cluster)
    matrix.record(
        f"worker dead after ready ({error.kind})",
        "the smoke watchdog: a smoke check fails, its health step reads the containers and the"
        " head's log",
        attempt.at - killed_at,
        BOUND_AT_ONCE_S,
        field_note="the watchdog runs every 30 minutes",
    )


# -- bad answers: the smoke test -------------------------------------------------------------

SMOKE_FAULTS = {
    "token_loop": "no_token_loops",
    "garbled": "no_garbled_text",
    "empty_content": "no_empty_content",
    "bad_after:5": "burst",
    "hang_long_prompt": "long_prompt",
}


@pytest.mark.parametrize(("fault", "check"), sorted(SMOKE_FAULTS.items()))
def test_a_bad_engine_fails_the_smoke_test_naming_the_check_and_is_rolled_back(
    cluster: str, lab_cluster: Lab, tmp_path: Path, matrix: Matrix, fault: str, check: str
) -> None:
    recipe = recipe_variant(
        tmp_path,
        "lab-bad-answers",
        SINGLE,
        with_env(STANDIN_FAULT=fault),
        ("[smoke]\n", f"[smoke]\nrequest_timeout_s = {SMOKE_REQUEST_TIMEOUT_S}\n"),
    )
    run = run_flow(deploy, recipe, cluster=cluster)
    assert run.failed
    assert isinstance(run.error, SmokeFailed), run.error
    attempt = run.named("smoke-test", node="node1", cause=check)
    failed = re.findall(r"^  (\w+): (.*)$", str(run.error), re.MULTILINE)
    if fault == "bad_after:5":  # the gate's one-token completion was the first good answer
        assert ("burst", "request 2 of 8 (#5 overall") in [(n, e[:26]) for n, e in failed]
    if fault == "hang_long_prompt":
        assert [(name, "no answer within" in evidence) for name, evidence in failed] == [
            ("long_prompt", True)
        ]
    started = next(at for message, at in run.logs if message.startswith("smoke test of"))
    nothing_left(lab_cluster, cluster)
    matrix.record(
        f"bad answers: {fault}",
        f"smoke-test: check {check}",
        attempt.at - started,
        SMOKE_REQUEST_TIMEOUT_S + BOUND_AT_ONCE_S,
        field_note="a hung request counts after the recipe's [smoke] request_timeout_s"
        if fault == "hang_long_prompt"
        else "",
    )


def test_after_the_engine_faults_the_recipe_deploys(cluster: str, lab_cluster: Lab) -> None:
    """The re-run of every engine fault above: each was the recipe's (its STANDIN_FAULT, a
    flag, a route, a memory cap) or the watchdog's killed worker, and each left the nodes
    clean, so one deploy on all three nodes, smoke test included, shows a re-run succeeds."""
    deploys("lab-dsv41-3x", cluster)
    teardown("lab-dsv41-3x", cluster=cluster)
    nothing_left(lab_cluster, cluster)


# -- deployments, Prefect and the lab --------------------------------------------------------


def test_two_deploys_racing_for_overlapping_nodes_never_both_run(
    cluster: str, lab_cluster: Lab, tmp_path: Path, matrix: Matrix
) -> None:
    """Started at the same moment: one takes its nodes, the other waits its lock_timeout_s
    and fails naming the first. A deploy that waits puts nothing on any node, not even on the
    nodes no one holds."""
    two_nodes = recipe_variant(tmp_path, "lab-two", SINGLE, *TWO_NODES)
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
    composing = recipe_variant(tmp_path, "lab-dsv41-wait", DSV41)
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


@dataclass
class Worker:
    """A Prefect process worker on the pool of prefect.yaml's deployments, started anew when
    a test killed it."""

    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None

    def running(self) -> subprocess.Popen[bytes]:
        if self.process is None or self.process.poll() is not None:
            self.process = start_worker(self.env, self.log)
        return self.process

    def submit(self, recipe: str, cluster: str) -> str:
        """`prefect deployment run deploy/deploy`; the flow run's id."""
        self.running()
        return deploy_run(self.env, recipe, cluster)


@pytest.fixture(scope="module")
def worker(
    cluster: str, prefect_harness: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    env = {
        **harness_env(prefect_harness),
        # Picks the runs up and sees their cancellation within a second (the default polls
        # every 10 s).
        "PREFECT_WORKER_QUERY_SECONDS": "1",
    }
    register_lab_deployments(env, names=["deploy"])
    started = Worker(env, tmp_path_factory.mktemp("worker") / "worker.log")
    yield started
    if started.process is not None:
        stop_worker(started.process)


def logged(flow_run_id: str, prefix: str, timeout_s: float = 60.0) -> tuple[str, float]:
    """The run's first log line starting with prefix (the hooks log after the run's end)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            said = [log for log in logs if log.message.startswith(prefix)]
            if said:
                return said[0].message, _wall(said[0].timestamp)
            assert time.monotonic() < deadline, f"the run never logged {prefix!r}"
            time.sleep(0.5)


def booting(lab: Lab, cluster: str, worker: Worker) -> None:
    """Once the run's containers exist (its boot has begun)."""
    inventory = load_cluster(Path(cluster))
    try:
        wait_for("the boot", lambda: cluster_status(inventory), timeout_s=300)
    except AssertionError:
        print(worker.log.read_text()[-5000:])
        raise


def ended_mid_boot(
    lab: Lab, cluster: str, recipe: str, worker: Worker, end: Callable[[str], None], hook: str
) -> float:
    """A deploy through the worker, ended by end(flow_run_id) once its engine boots; its hook
    then tears it down and logs `hook: tore down ...` naming node1. Seconds from end to that."""
    flow_run_id = worker.submit(recipe, cluster)
    booting(lab, cluster, worker)
    ended_at = time.time()
    end(flow_run_id)
    state = wait_for_state(flow_run_id)
    assert state.name is not None and state.name.lower() == hook, state
    said, at = logged(flow_run_id, f"{hook}: tore down")
    assert "node1" in said, said
    nothing_left(lab, cluster)
    return at - ended_at


def worker_killed_mid_boot(
    lab: Lab, cluster: str, recipe: str, worker: Worker, matrix: Matrix
) -> None:
    """The worker SIGKILLed during the boot. The flow run's process is not in the worker's
    process group; Prefect 3.9's either carries on to the end (the deployment serves) or
    notices its worker gone and ends Crashed, and then its on_crashed hook tears down. Either
    way nothing waits for a person."""
    flow_run_id = worker.submit(recipe, cluster)
    booting(lab, cluster, worker)
    killed = worker.running()
    killed_at = time.time()
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    state = wait_for_state(flow_run_id)
    if state.is_completed():
        [running] = cluster_status(load_cluster(Path(cluster)))
        assert running.deployment_id == load_plan(recipe, cluster).deployment_id, running
        teardown(recipe, cluster=cluster)
        outcome, seconds = "the flow's process carried on: deployed", None
    else:
        assert state.is_crashed(), state
        said, at = logged(flow_run_id, "crashed: tore down")
        assert "node1" in said, said
        outcome, seconds = "the run ended Crashed; its on_crashed hook tore down", at - killed_at
    nothing_left(lab, cluster)
    matrix.record(
        "the worker killed mid-deploy",
        "the flow run's own process (it outlives the worker, or sees it go)",
        seconds,
        BOUND_WORKER_S,
        outcome=outcome,
    )


def test_a_deploy_cancelled_or_killed_under_its_worker_leaves_nothing_in_the_way(
    cluster: str, lab_cluster: Lab, tmp_path: Path, worker: Worker, matrix: Matrix
) -> None:
    """Deploys run by a Prefect process worker, each caught while its engine boots slowly:
    cancelled, its process killed, its worker killed. Then the next deploy of the node takes
    it at once (lock_timeout_s=1): nobody had to step in."""
    recipe = recipe_variant(tmp_path, "lab-slow", SINGLE, with_env(STANDIN_FAULT="slow_boot:20"))

    def cancel(flow_run_id: str) -> None:
        run_prefect(worker.env, "flow-run", "cancel", flow_run_id)

    def kill_its_process(flow_run_id: str) -> None:
        """As the OOM killer or a person would: the worker then marks the run Crashed."""
        process = wait_for(
            "the flow run's process", lambda: flow_process(worker.running().pid, flow_run_id)
        )
        os.kill(process, signal.SIGKILL)

    for end, hook, fault, detected_by in (
        (
            cancel,
            "cancelled",
            "deploy cancelled mid-boot",
            "the deploy's on_cancellation hook, run by the worker once the flow's process ended",
        ),
        (
            kill_its_process,
            "crashed",
            "the deploy's process killed mid-boot",
            "the worker marks the run Crashed; the deploy's on_crashed hook tears down",
        ),
    ):
        seconds = ended_mid_boot(lab_cluster, cluster, recipe, worker, end, hook)
        matrix.record(fault, detected_by, seconds, BOUND_WORKER_S)
    worker_killed_mid_boot(lab_cluster, cluster, recipe, worker, matrix)
    deploys("lab-single", cluster, skip=["smoke-test"], lock_timeout_s=1)
    teardown("lab-single", cluster=cluster)
    nothing_left(lab_cluster, cluster)


def test_a_redeploy_cancelled_during_its_prefetch_leaves_the_serving_copy_held_and_serving(
    cluster: str, lab_cluster: Lab, worker: Worker, matrix: Matrix
) -> None:
    """A second run of a serving deployment takes its node holds over as its prefetch begins
    (same deployment, the first run has ended). Cancelled while the prefetch waits out the
    hub's Retry-After, its hook removes only what it started (nothing): the serving containers
    stay, still answer, and the holds name the run that serves again."""
    first = worker.submit("lab-single", cluster)
    assert wait_for_state(first, timeout_s=300).is_completed()
    plan = load_plan("lab-single", cluster)
    nodes = [node.node for node in plan.nodes]
    [serving] = cluster_status(load_cluster(Path(cluster)))
    assert {holder.flow_run_id for holder in holders(plan.cluster, nodes).values() if holder} == {
        first
    }
    hub_faults(lab_cluster, fail_next=1, status=429, retry_after=240)
    try:
        # update_revisions: the prefetch asks the hub for main (the NAS holds it complete, so a
        # plain redeploy would not), and the hub's 429 holds it there for 240 s.
        worker.running()
        second = deployment_run(
            worker.env,
            "deploy/deploy",
            {"recipe": "lab-single", "cluster": cluster, "update_revisions": True},
        )
        wait_for(
            "the redeploy taking the holds over",
            lambda: all(
                holder is not None and holder.flow_run_id == second
                for holder in holders(plan.cluster, nodes).values()
            ),
            timeout_s=120,
        )
        cancelled_at = time.time()
        run_prefect(worker.env, "flow-run", "cancel", second)
        assert wait_for_state(second).is_cancelled()
        said, at = logged(second, "cancelled: tore down")
        # The hold goes back in the run's own rollback (its process got SIGTERM) or, if that
        # process died first, in the hook.
        handed, _ = logged(second, f"node {nodes[0]}: {plan.deployment_id} still serves there")
    finally:
        hub_faults(lab_cluster, reset=True)
    assert "no container left" in said, said
    assert first in handed, handed
    [after] = cluster_status(load_cluster(Path(cluster)))
    assert [(c.name, c.started_at, c.status) for c in after.containers] == [
        (c.name, c.started_at, "running") for c in serving.containers
    ]
    assert {holder.flow_run_id for holder in holders(plan.cluster, nodes).values() if holder} == {
        first
    }
    ask(plan.endpoint, plan.served_model_name, "Say OK.")  # the request must succeed
    matrix.record(
        "a redeploy of a serving deployment cancelled during its prefetch",
        "the run's rollback and its on_cancellation hook remove only what the run started",
        at - cancelled_at,
        BOUND_WORKER_S,
        outcome="the serving copy stays up, held by the run that started it",
    )
    teardown("lab-single", cluster=cluster)
    nothing_left(lab_cluster, cluster)


def test_the_lab_rebuilt_under_held_locks_is_taken_over_at_once(
    lab_cluster: Lab, lab_engine_image: str, tmp_path: Path, matrix: Matrix
) -> None:
    """A lab of its own (one node): lab-single deployed, the lab brought down and up again (the
    nodes wiped, as a reboot or a re-imaged node does) while Prefect still records the node as
    held. The next deploy, of another recipe, takes it over at once, naming the old holder."""
    rebuilt = Lab(f"{lab_cluster.name[:17]}-rb", 1)
    cluster = str(rebuilt.inventory_path)
    other = recipe_variant(tmp_path, "lab-other", SINGLE)

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
        assert old.deployment_id in said and str(old.flow_run_id) in said, said
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
