"""Many deployments at once: four concurrent 2-node warm deploys against one alone, on SQLite and
on PostgreSQL.

One 8-node lab; for each database a Prefect server of its own (with its services), nginx in
front of it counting the requests of the worker and the flow runs, and a process worker on this
host polling every second. Each round deploys `recipes/lab-pair` warm (the model prefetched, the
image pulled by a cold wave first) on node1-2 alone, then on node1-2 ... node7-8 at once, each
wave's flow runs created at the same moment through Prefect's API (what `prefect deployment run`
does). Prints each wave's wall time (from the runs' creation to the last one's end) and the CPU
it cost, the ratio of the four-at-once wall time to the single one with the best ratio this
machine's cores allow (bench/cpu.py), and per deploy the server's requests and CPU time.
Target: the four-at-once wall time <= 2x the single deploy's, or within 10 % of the CPU bound.
Needs root.

    .venv/bin/python -m bench.concurrent_deploys [--rounds 2] [--databases sqlite,postgresql]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.cpu import CpuUsage, cpu_bound_ratio, measured
from lab.cluster import Lab
from lab.image import build_engine_image
from lab.models import publish_lab_models
from lab.postgres import PostgresServer
from lab.prefect_local import (
    PrefectServer,
    free_port,
    register_deployments,
    start_worker,
    stop_worker,
)
from lab.team import nginx_config

RECIPE = "lab-pair"
NODE_SETS = [["node1", "node2"], ["node3", "node4"], ["node5", "node6"], ["node7", "node8"]]
WAVE_TIMEOUT_S = 900.0
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def session_cpu_s(session_id: int) -> float:
    """CPU seconds of every process in a session (the server's: prefect, uvicorn), including
    its children that have ended."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[3]) == session_id:
            total += sum(int(value) for value in fields[11:15])
    return total / _TICKS_PER_S


@dataclass
class Wave:
    deploys: int
    usage: CpuUsage
    requests: int
    server_cpu_s: float


@dataclass
class Stack:
    """A Prefect server on one database, nginx in front of it, a worker: what a wave runs on."""

    server: PrefectServer
    access_log: Path
    cluster: str

    def requests(self) -> int:
        return len(self.access_log.read_bytes().splitlines()) if self.access_log.exists() else 0

    def wave(self, recipe: str, node_sets: Sequence[Sequence[str]], flow: str) -> Wave:
        from prefect.client.orchestration import get_client

        requests, server_cpu = self.requests(), session_cpu_s(self.server.pid or 0)
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name(flow)
            with measured() as usage:
                runs = [
                    client.create_flow_run_from_deployment(
                        deployment.id,
                        parameters={
                            "recipe": recipe,
                            "cluster": self.cluster,
                            "nodes": list(nodes),
                        },
                    ).id
                    for nodes in node_sets
                ]
                deadline = time.monotonic() + WAVE_TIMEOUT_S
                while True:
                    states = [client.read_flow_run(run).state_type for run in runs]
                    if all(state is not None and state.value in FINAL for state in states):
                        break
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{flow}: runs not done after {WAVE_TIMEOUT_S:.0f} s")
                    time.sleep(0.2)
        failed = [state for state in states if state is None or state.value != "COMPLETED"]
        if failed:
            raise SystemExit(f"{flow} on {node_sets}: {failed}")
        return Wave(
            len(runs),
            usage,
            self.requests() - requests,
            session_cpu_s(self.server.pid or 0) - server_cpu,
        )


@contextlib.contextmanager
def stack(lab: Lab, database: str, workdir: Path) -> Iterator[Stack]:
    """Prefect on `database` (sqlite or postgresql), nginx counting requests, one worker."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    processes: list[subprocess.Popen[bytes]] = []
    postgres = None
    server = None
    try:
        database_url = None
        if database == "postgresql":
            postgres = PostgresServer(workdir / "postgres", free_port())
            postgres.start()
            postgres.create_database("prefect")
            database_url = postgres.database_url("prefect")
        server = PrefectServer(workdir / "prefect", port=free_port(), database_url=database_url)
        server.start()
        port = free_port()
        access_log = workdir / "access.log"
        config = workdir / "nginx.conf"
        config.write_text(
            nginx_config(
                workdir, f"127.0.0.1:{port}", [f"127.0.0.1:{server.port}"], access_log=access_log
            )
        )
        processes.append(
            subprocess.Popen(
                ["nginx", "-c", str(config), "-g", "daemon off;"], start_new_session=True
            )
        )
        env = {**server.env(), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
        register_deployments(server.env(), ["deploy", "teardown"])
        processes.append(
            start_worker({**env, "PREFECT_WORKER_QUERY_SECONDS": "1"}, workdir / "worker.log")
        )
        with temporary_settings({PREFECT_API_URL: server.api_url}):
            yield Stack(server, access_log, str(lab.inventory_path))
    finally:
        for process in reversed(processes):
            stop_worker(process)
        if server is not None:
            server.stop()
        if postgres is not None:
            postgres.remove()


def measure(lab: Lab, database: str, rounds: int, workdir: Path) -> list[tuple[Wave, Wave]]:
    with stack(lab, database, workdir) as running:
        print(f"{database}: cold wave (prefetch, pulls) ...", flush=True)
        running.wave(RECIPE, NODE_SETS, "deploy/deploy")
        running.wave(RECIPE, NODE_SETS, "teardown/teardown")
        measured_rounds = []
        for round_number in range(1, rounds + 1):
            waves = []
            for node_sets in (NODE_SETS[:1], NODE_SETS):
                wave = running.wave(RECIPE, node_sets, "deploy/deploy")
                running.wave(RECIPE, node_sets, "teardown/teardown")
                print(
                    f"  {database}, round {round_number}, {wave.deploys} at once: wall"
                    f" {wave.usage.wall_s:.2f} s; CPU {wave.usage.busy_s:.2f} s"
                    f" ({wave.usage.top(5)}); server: {wave.requests} requests,"
                    f" {wave.server_cpu_s:.2f} s CPU; stolen {wave.usage.stolen_s:.2f} s",
                    flush=True,
                )
                waves.append(wave)
            measured_rounds.append((waves[0], waves[1]))
        return measured_rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--databases", default="sqlite,postgresql")
    options = parser.parse_args()
    lab = Lab("benchconc", 8)
    lab.up()
    results: dict[str, list[tuple[Wave, Wave]]] = {}
    try:
        build_engine_image(lab)
        publish_lab_models(lab.hub_repos_dir)
        for database in options.databases.split(","):
            # Under the lab's state dir (removed with it), which PostgreSQL's user can reach.
            workdir = lab.layout.state_dir / f"bench-{database}"
            workdir.mkdir()
            results[database] = measure(lab, database, options.rounds, workdir)
    finally:
        lab.down()
    for database, rounds in results.items():
        single = statistics.median(one.usage.wall_s for one, _ in rounds)
        four = statistics.median(many.usage.wall_s for _, many in rounds)
        bound = statistics.median(cpu_bound_ratio(one.usage, many.usage) for one, many in rounds)
        deploys = sum(one.deploys + many.deploys for one, many in rounds)
        requests = sum(one.requests + many.requests for one, many in rounds) / deploys
        server_cpu = sum(one.server_cpu_s + many.server_cpu_s for one, many in rounds) / deploys
        ratio = four / single
        verdict = "met" if ratio <= 2.0 or ratio <= bound * 1.1 else "NOT met"
        print(
            f"{database}: one deploy {single:.2f} s, four at once {four:.2f} s: ratio"
            f" {ratio:.2f} (this machine's CPU allows {bound:.2f}); per deploy"
            f" {requests:.0f} server requests, {server_cpu:.2f} s server CPU;"
            f" target (ratio <= 2, or within 10 % of the CPU bound) {verdict}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
