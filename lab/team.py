"""Prefect as a team runs it (README: Running it for a team), on one machine with the lab.

Prefect's production layout (https://docs.prefect.io/v3/advanced/self-hosted): PostgreSQL
(lab.postgres); Redis for messaging, event ordering, concurrency leases and the services'
task queue (prefect-redis); two API servers without background services, behind a load
balancer (Debian's nginx, which sends a request to the other server when one refuses the
connection); one process running the background services; and process workers of one pool on
the lab's ops hosts (network namespaces on the lab fabric), which reach the API through the
balancer on the lab host's fabric address; flow runs beat, and the zombie automation
(`sparkdeploy zombies`) crashes those whose heartbeats stop. Everything is a child process,
stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from uuid import UUID

from lab.cluster import Lab
from lab.postgres import PostgresServer
from lab.prefect_local import (
    SERVER_KEEPALIVE_S,
    PrefectServer,
    free_port,
    start_services,
    start_worker,
    stop_worker,
)
from lab.processes import start_logged
from sparkdeploy.errors import LabError
from sparkdeploy.report.zombies import MIN_HEARTBEAT_S

DATABASE = "prefect"
START_TIMEOUT_S = 30.0
# The balancer waits this long for an API server's answer: a deploy's longest request is a log
# or artifact upload, far shorter.
PROXY_READ_TIMEOUT_S = 300


def redis_settings(redis_url: str) -> dict[str, str]:
    """The server settings that put Prefect's messaging, event ordering, leases and services
    queue on Redis, as its self-hosted guide has it for several servers."""
    return {
        "PREFECT_MESSAGING_BROKER": "prefect_redis.messaging",
        "PREFECT_MESSAGING_CACHE": "prefect_redis.messaging",
        "PREFECT_SERVER_EVENTS_CAUSAL_ORDERING": "prefect_redis.ordering",
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect_redis.lease_storage",
        "PREFECT_REDIS_MESSAGING_URL": f"{redis_url}/0",
        "PREFECT_SERVER_DOCKET_URL": f"{redis_url}/1",
    }


def nginx_config(
    workdir: Path, listen: str, upstreams: list[str], *, access_log: Path | None = None
) -> str:
    """A balancer over the API servers: a request whose server refuses or drops the connection
    goes to the next one (`proxy_next_upstream error`, POSTs too: the request never reached a
    server that refused it), websockets (Prefect's event stream) pass through. With access_log,
    one line per request (bench/concurrent.py counts them)."""
    servers = "".join(
        f"    server {address} max_fails=1 fail_timeout=10s;\n" for address in upstreams
    )
    return (
        # Its workers write temporary files under the lab's root-owned directories.
        "user root;\n"
        "worker_processes 1;\n"
        f"pid {workdir / 'nginx.pid'};\n"
        f"error_log {workdir / 'nginx-error.log'} warn;\n"
        "events { worker_connections 1024; }\n"
        "http {\n"
        f"  access_log {access_log or 'off'};\n"
        f"  client_body_temp_path {workdir / 'nginx-body'};\n"
        f"  proxy_temp_path {workdir / 'nginx-proxy'};\n"
        f"  fastcgi_temp_path {workdir / 'nginx-fastcgi'};\n"
        f"  uwsgi_temp_path {workdir / 'nginx-uwsgi'};\n"
        f"  scgi_temp_path {workdir / 'nginx-scgi'};\n"
        "  client_max_body_size 100m;\n"
        "  map $http_upgrade $connection_upgrade { default upgrade; '' ''; }\n"
        "  upstream prefect {\n"
        f"{servers}"
        "    keepalive 32;\n"
        "  }\n"
        "  server {\n"
        f"    listen {listen};\n"
        # Longer than Prefect's client keeps an idle connection (SERVER_KEEPALIVE_S).
        f"    keepalive_timeout {SERVER_KEEPALIVE_S}s;\n"
        "    location / {\n"
        "      proxy_pass http://prefect;\n"
        "      proxy_http_version 1.1;\n"
        "      proxy_set_header Host $host;\n"
        "      proxy_set_header Upgrade $http_upgrade;\n"
        "      proxy_set_header Connection $connection_upgrade;\n"
        f"      proxy_read_timeout {PROXY_READ_TIMEOUT_S}s;\n"
        "      proxy_next_upstream error non_idempotent;\n"
        "      proxy_next_upstream_tries 2;\n"
        "    }\n"
        "  }\n"
        "}\n"
    )


@dataclass
class TeamControlPlane:
    """PostgreSQL, Redis, `api_servers` API servers, the services and the balancer, for a lab
    whose ops hosts run the workers (start_worker)."""

    lab: Lab
    workdir: Path
    api_servers: int = 2
    database: PostgresServer | None = field(default=None, init=False)
    servers: list[PrefectServer] = field(default_factory=list, init=False)
    balancer_port: int = field(default=0, init=False)
    _processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, init=False)

    @property
    def api_url(self) -> str:
        """The balancer's: what workers, flow runs and the CLI use."""
        return f"http://{self.lab.host_ip}:{self.balancer_port}/api"

    def env(self, home: str = "client") -> dict[str, str]:
        """A Prefect client's environment (CLI, worker): the API through the balancer."""
        return {
            **os.environ,
            "PREFECT_HOME": str(self.workdir / home),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            # Flow runs beat, so one whose worker died is found by its silence (zombies).
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(MIN_HEARTBEAT_S),
        }

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir(parents=True)
        self.database = PostgresServer(self.workdir / "postgres", free_port())
        self.database.start()
        self.database.create_database(DATABASE)
        redis_port = free_port()
        self._spawn(
            "redis",
            [
                *("redis-server", "--bind", "127.0.0.1", "--port", str(redis_port)),
                *("--save", "", "--appendonly", "no", "--dir", str(self.workdir)),
            ],
        )
        self._wait(f"redis on port {redis_port}", lambda: _answers("127.0.0.1", redis_port))
        settings = redis_settings(f"redis://127.0.0.1:{redis_port}")
        for number in range(1, self.api_servers + 1):
            server = PrefectServer(
                self.workdir / f"api{number}",
                port=free_port(self.lab.host_ip),
                log_path=self.workdir / f"api{number}.log",
                host=self.lab.host_ip,
                database_url=self.database.database_url(DATABASE),
                run_services=False,
                server_settings=settings,
            )
            # One at a time: the first migrates the database.
            server.start()
            self.servers.append(server)
        self._processes["services"] = start_services(self.servers[0], self.workdir / "services.log")
        self.balancer_port = free_port(self.lab.host_ip)
        config = self.workdir / "nginx.conf"
        config.write_text(
            nginx_config(
                self.workdir,
                f"{self.lab.host_ip}:{self.balancer_port}",
                [f"{server.host}:{server.port}" for server in self.servers],
            )
        )
        self._spawn("balancer", ["nginx", "-c", str(config), "-g", "daemon off;"])
        self._wait(
            f"nginx on {self.lab.host_ip}:{self.balancer_port}",
            lambda: _answers(self.lab.host_ip, self.balancer_port),
        )
        subprocess.run(
            [
                str(Path(sys.executable).with_name("sparkdeploy")),
                *("zombies", "--heartbeat-s", str(MIN_HEARTBEAT_S)),
            ],
            env=self.env(),
            check=True,
            capture_output=True,
            timeout=120,
        )

    def start_worker(self, ops_host: str, *, limit: int | None = None) -> subprocess.Popen[bytes]:
        """A process worker named after the ops host, in its namespace, running at most `limit`
        flow runs at once when given."""
        worker = start_worker(
            self.env(ops_host),
            self.workdir / f"worker-{ops_host}.log",
            name=ops_host,
            wrapper=self.lab.on_ops_host(ops_host),
            limit=limit,
        )
        self._processes[f"worker {ops_host}"] = worker
        return worker

    def kill_api_server(self, number: int) -> None:
        """API server `number` (from 1) SIGKILLed, as when its host is lost."""
        server = self.servers[number - 1]
        if server.pid is not None:
            os.killpg(server.pid, signal.SIGKILL)
        server.stop()

    def ran_on(self, flow_run_id: str) -> str | None:
        """The ops host whose worker took the run (workers are named after their host): the
        worker that won the run's Pending state labels it before starting its process
        (`prefect.worker.name`), so a worker whose submission the server aborted never shows."""
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with (
            temporary_settings({PREFECT_API_URL: self.api_url}),
            get_client(sync_client=True) as client,
        ):
            run = client.read_flow_run(UUID(flow_run_id))
        name = run.labels.get("prefect.worker.name")
        return str(name) if name is not None else None

    def _spawn(self, what: str, argv: list[str]) -> None:
        self._processes[what] = start_logged(argv, self.workdir / f"{what}.log")

    def _wait(self, what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            if time.monotonic() > deadline:
                raise LabError(f"{what} did not answer within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)

    def stop(self) -> None:
        """The workers first (no new runs start), then Redis, the services and the balancer, the
        API servers, and the database last, removed with its data. Flow runs that outlive their
        worker are the lab's to end (Lab.down stops every process of its ops hosts)."""
        for what in sorted(self._processes, key=lambda name: not name.startswith("worker")):
            stop_worker(self._processes.pop(what))
        for server in self.servers:
            server.stop()
        self.servers.clear()
        if self.database is not None:
            self.database.remove()
            self.database = None


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False
