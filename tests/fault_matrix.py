"""What the tests of the fault matrix (issue 12) share: every fault through the real pipeline
on the lab, in tests/test_fault_matrix_*.py, a file for each part that breaks (the nodes, the hub
and the NAS, staging, the engine, the node locks, the Prefect worker).

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
where it recovers) is measured into the session's `matrix` (tests/conftest.py) and written as a
table to <lab root>/fault-matrix-<lab>.md and to the end of the pytest output. README.md quotes
it. The bounds are generous on purpose: CI runs on two shared cores; a test never asserts the
measured time itself.

The tasks' retry delays (10 s to 300 s in the field) are shortened to RETRY_DELAY_S
(tests/conftest.py's `short_retry_delays`); the table says what they add in the field. Faults
that only real vLLM shows are in tests/test_real_engine.py, named in
tests/test_fault_matrix_engine.py's FATAL_KINDS_OF_THE_REAL_ENGINE.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from lab_flows import nothing_runs, settled_task_runs

from flows.deploy import deploy
from lab.cluster import Lab
from sparkdeploy.remote.ssh import cached_connection

# Every test of the matrix: on the lab, with the retried tasks' short delays, and whatever a
# test left removed after it.
FAULT_MATRIX_MARKS = [
    pytest.mark.lab,
    pytest.mark.usefixtures("prefect_harness", "short_retry_delays", "clean_lab_after"),
]

# A failure the pipeline sees at once (a refused connection, a fatal log line, an exit, a
# full disk): the step that meets it fails within seconds; the rest is a loaded CI machine.
BOUND_AT_ONCE_S = 15.0
# How long a process an SSH session started may outlive its session (it notices at its next
# write); the staging copy writes a progress line at least every chunk.
PROCESS_GONE_S = 15.0
DOCKER_S = 60.0
# How long a test waits for the moment its fault strikes (a copy begun, a process started, a
# boot begun), and how often it looks: often, so that the fault strikes mid-way.
STRIKE_WAIT_S = 120.0
STRIKE_POLL_S = 0.01


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
            assert node in message, message
            assert re.search(cause, message), message
        return first


RETRIED_ATTEMPT = "Task run failed with exception: "


def wall_time(timestamp: datetime) -> float:
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
                Attempt(task_run.name, past.message or "", wall_time(past.timestamp), final=True)
                for past in client.read_task_run_states(task_run.id)
                if past.is_failed()
            ]
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    attempts += [
        Attempt(
            names.get(log.task_run_id, "?") if log.task_run_id else "flow",
            log.message.removeprefix(RETRIED_ATTEMPT),
            wall_time(log.timestamp),
            final=False,
        )
        for log in logs
        if log.message.startswith(RETRIED_ATTEMPT) and log.message.endswith("from now")
    ]
    lines = sorted(((log.message, wall_time(log.timestamp)) for log in logs), key=lambda m: m[1])
    return Run(state, started, ended, sorted(attempts, key=lambda a: a.at), lines)


def deploys(recipe: str, cluster: str, **kwargs: Any) -> Run:
    """A deploy that must succeed (a re-run after the fault is cleared); torn down after."""
    run = run_flow(deploy, recipe, cluster=cluster, **kwargs)
    assert run.state.is_completed(), run.state.message
    return run


# -- what is left ----------------------------------------------------------------------------

# A node's own daemons; every other process there is a container's or an SSH session's.
NODE_DAEMONS = frozenset({"sshd", "sshd-session", "dockerd", "containerd"})


def node_processes(lab: Lab, node: str) -> dict[int, tuple[int, str, str]]:
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
        processes = node_processes(lab, node)

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


# -- what a test breaks ----------------------------------------------------------------------

# recipe_variant replacements that spread lab-single over two nodes, tensor parallel.
TWO_NODES = (
    ("required_nodes = 1", "required_nodes = 2"),
    ("tensor_parallel_size = 1", "tensor_parallel_size = 2"),
)


def hub_faults(lab: Lab, **switches: Any) -> None:
    """POST /_lab/faults on the lab hub (lab/hub/): fail_next + status, cut_next_file, reset."""
    request = urllib.request.Request(
        f"{lab.hub_url}/_lab/faults",
        data=json.dumps(switches).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200
