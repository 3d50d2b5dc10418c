"""A flow run's start through a process worker (issue 24.2): from a `deploy` run's creation (as
`prefect deployment run` or the repair automation creates it) to the worker's claim of it
(Pending) and to the flow's Running state, for a worker polling at Prefect's default interval
and for one polling at the interval this project configures (pyproject.toml's
[tool.prefect.worker]), measured in one run on a Prefect server of its own. Also: what a
worker's polling costs the server and the worker (CPU seconds an hour, idle), and the floor of
the flow process's start (the interpreter importing prefect, then the deploy flow's module).

Each run is a deploy of a cluster file that does not exist, so the flow fails in its plan step
at once: what is measured ends at Running, before the flow's first step. Before each run the
bench waits a random part of the poll interval, so that runs land anywhere in the worker's
cycle, as the automation's do.

    .venv/bin/python -m bench.worker_start [--runs 8] [--idle-s 60]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from bench.cpu import cpu_seconds_by_command
from lab.prefect_local import (
    PROJECT_ROOT,
    PrefectServer,
    free_port,
    register_deployments,
    start_worker,
    stop_worker,
)
from lab.testing.waiting import wait_for

PREFECT_DEFAULT_QUERY_S = 10.0
NOWHERE = "/nonexistent/bench-worker-start/cluster.toml"


@dataclass(frozen=True)
class Start:
    claimed_s: float  # creation -> Pending (the worker's poll found it)
    running_s: float  # creation -> Running (its process started and imported the flow)

    @property
    def process_s(self) -> float:
        return self.running_s - self.claimed_s


def configured_query_s() -> float:
    """The poll interval pyproject.toml gives the workers started in this project's directory."""
    import tomllib

    settings = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())
    return float(settings["tool"]["prefect"]["worker"]["query_seconds"])


def worker_env(server: PrefectServer, query_s: float | None) -> dict[str, str]:
    """The server's client environment; query_s None: the interval the worker gets from the
    project's settings, else that interval (an environment variable wins over the file)."""
    env = {k: v for k, v in server.env().items() if k != "PREFECT_WORKER_QUERY_SECONDS"}
    if query_s is not None:
        env["PREFECT_WORKER_QUERY_SECONDS"] = str(query_s)
    return env


def one_start(env: Mapping[str, str]) -> Start:
    """One deploy run created, waited to its end; its creation-to-Pending and -to-Running."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import FlowRun
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}):
        # Called from sync code, Prefect's dispatch returns the run, not a coroutine.
        run = cast(
            FlowRun,
            run_deployment(
                "deploy/deploy", parameters={"recipe": "lab-single", "cluster": NOWHERE}, timeout=0
            ),
        )
        with get_client(sync_client=True) as client:
            wait_for(
                f"flow run {run.id} to end",
                lambda: bool(
                    (state := client.read_flow_run(run.id).state) is not None and state.is_final()
                ),
                timeout_s=120,
                poll_s=0.5,
            )
            states = client.read_flow_run_states(run.id)
    first = {state.type.value: state.timestamp for state in reversed(states)}
    created = run.created
    if created is None or "PENDING" not in first or "RUNNING" not in first:
        raise SystemExit(f"flow run {run.id}: no Pending or Running state in {states}")
    return Start(
        claimed_s=(first["PENDING"] - created).total_seconds(),
        running_s=(first["RUNNING"] - created).total_seconds(),
    )


def starts(env: Mapping[str, str], query_s: float, runs: int, log: Path) -> list[Start]:
    worker = start_worker(env, log)
    try:
        time.sleep(query_s + 3)  # its first poll done: the pool has a worker
        measured = []
        for number in range(1, runs + 1):
            time.sleep(random.uniform(0, query_s))
            start = one_start(env)
            print(
                f"  poll every {query_s:g} s, run {number}: claimed after {start.claimed_s:.2f} s,"
                f" running after {start.running_s:.2f} s (its process {start.process_s:.2f} s)",
                flush=True,
            )
            measured.append(start)
        return measured
    finally:
        stop_worker(worker)


def idle_cost(server: PrefectServer, env: Mapping[str, str], idle_s: float, log: Path) -> float:
    """CPU seconds an hour that an idle polling worker costs its server and itself."""
    worker = start_worker(env, log)
    try:
        time.sleep(5)  # past its start-up
        before = cpu_seconds_by_command()
        time.sleep(idle_s)
        after = cpu_seconds_by_command()
    finally:
        stop_worker(worker)
    # The server's and the worker's process groups: a worker or server is a `prefect` (python)
    # process and its forks, all in their leader's session.
    groups = {server.pid, worker.pid}
    spent = sum(
        seconds - before.get((pid, name), 0.0)
        for (pid, name), seconds in after.items()
        if _session(pid) in groups
    )
    return spent * 3600 / idle_s


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def import_s(module: str, env: Mapping[str, str]) -> float:
    """The best of three: a fresh interpreter importing `module`, from the project root."""
    times = []
    for _ in range(3):
        started = time.monotonic()
        subprocess.run(
            [sys.executable, "-c", f"import {module}"], env=dict(env), cwd=PROJECT_ROOT, check=True
        )
        times.append(time.monotonic() - started)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=8, help="runs per poll interval")
    parser.add_argument("--idle-s", type=float, default=60.0, help="idle window for the cost")
    options = parser.parse_args()
    configured = configured_query_s()
    with tempfile.TemporaryDirectory(prefix="bench-worker-start-") as scratch:
        workdir = Path(scratch)
        server = PrefectServer(workdir / "prefect", port=free_port())
        server.start()
        try:
            register_deployments(server.env(), ["deploy"])
            default_env = worker_env(server, PREFECT_DEFAULT_QUERY_S)
            configured_env = worker_env(server, None)
            floor_prefect = import_s("prefect.engine", default_env)
            floor_flow = import_s("flows.deploy", default_env)
            by_interval = {
                PREFECT_DEFAULT_QUERY_S: starts(
                    default_env, PREFECT_DEFAULT_QUERY_S, options.runs, workdir / "w-default.log"
                ),
                configured: starts(
                    configured_env, configured, options.runs, workdir / "w-configured.log"
                ),
            }
            cost = {
                PREFECT_DEFAULT_QUERY_S: idle_cost(
                    server, default_env, options.idle_s, workdir / "idle-default.log"
                ),
                configured: idle_cost(
                    server, configured_env, options.idle_s, workdir / "idle-configured.log"
                ),
            }
        finally:
            server.stop()
    print()
    print(
        f"the flow process's floor: a fresh interpreter imports prefect.engine in"
        f" {floor_prefect:.2f} s, flows.deploy in {floor_flow:.2f} s"
    )
    medians = {}
    for query_s, measured in by_interval.items():
        claimed = statistics.median(start.claimed_s for start in measured)
        running = statistics.median(start.running_s for start in measured)
        process = statistics.median(start.process_s for start in measured)
        medians[query_s] = running
        print(
            f"poll every {query_s:g} s: claimed {claimed:.2f} s, running {running:.2f} s (median;"
            f" max {max(start.running_s for start in measured):.2f} s), of which the process"
            f" {process:.2f} s; idle polling costs {cost[query_s]:.1f} CPU s an hour"
        )
    ratio = medians[configured] / medians[PREFECT_DEFAULT_QUERY_S]
    print(
        f"start through a worker, configured ({configured:g} s) / Prefect's default"
        f" ({PREFECT_DEFAULT_QUERY_S:g} s): {ratio:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
