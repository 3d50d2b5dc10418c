"""A local Prefect server (SQLite under PREFECT_HOME, or a PostgreSQL database) and process
workers, on the flow host or on the lab's ops hosts, for the demo and tests.

Everything here is a child process started with an explicit environment and stopped by PID.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lab.processes import start_logged, stop_process_group, wait_until_ready
from sparkdeploy.errors import SparkDeployError

WORK_POOL = "sparkdeploy"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
# The lab's deployments: prefect.yaml at the root is the team's clusters'.
LAB_PREFECT_FILE = Path(__file__).resolve().parent / "prefect.yaml"
# A fresh SQLite database takes about 20 s to migrate on 2 cores (docs/field.md); allow for a
# slow CI.
SERVER_START_TIMEOUT_S = 180.0
# Prefect's client keeps an idle connection for 25 s and reuses it; a server that closes idle
# connections sooner (uvicorn's default is 5 s) races the next request on one, which then fails
# with "Server disconnected without sending a response". The server must outwait the client.
SERVER_KEEPALIVE_S = 30
# How `prefect deployment run` names the flow run it created.
FLOW_RUN_ID = re.compile(r"UUID:\s*([0-9a-f-]{36})")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _prefect_cli() -> str:
    return str(Path(sys.executable).with_name("prefect"))


@dataclass
class PrefectServer:
    """`prefect server start` with its own PREFECT_HOME: on its own SQLite database there, or on
    `database_url` (PostgreSQL, lab.postgres) which other servers may share. `host` is loopback,
    or the lab host's fabric address for workers on the ops hosts. With run_services False it
    serves the API only, and `prefect server services start` (start_services) runs the
    background services once for every API server of the database, as Prefect's HA setup has it
    (https://docs.prefect.io/v3/advanced/self-hosted)."""

    home: Path
    port: int = 4200
    log_path: Path | None = None
    host: str = "127.0.0.1"
    database_url: str | None = None
    run_services: bool = True
    # Settings of the server process alone (Redis messaging, say), beside the database's.
    server_settings: Mapping[str, str] = field(default_factory=dict)
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.port}/api"

    @property
    def pid(self) -> int | None:
        """The server's process (group) id while this object runs it."""
        return self._process.pid if self._process is not None else None

    @property
    def ui_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """The environment a Prefect client, worker or flow needs to talk to this server."""
        return {
            **os.environ,
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOGGING_LEVEL": os.environ.get("PREFECT_LOGGING_LEVEL", "INFO"),
        }

    def server_env(self) -> dict[str, str]:
        """The server process's environment: a client's, with the database and its settings."""
        env = {**self.env(), **self.server_settings}
        if self.database_url is not None:
            env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = self.database_url
        return env

    def is_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def start(self) -> None:
        if self.is_healthy():
            raise SparkDeployError(
                f"a Prefect server already answers on {self.api_url}; stop it or pick another port"
            )
        self.home.mkdir(parents=True, exist_ok=True)
        log_path = self.log_path or self.home / "server.log"
        self._process = start_logged(
            [
                _prefect_cli(),
                "server",
                "start",
                "--host",
                self.host,
                "--port",
                str(self.port),
                "--keep-alive-timeout",
                str(SERVER_KEEPALIVE_S),
                *([] if self.run_services else ["--no-services"]),
            ],
            log_path,
            env=self.server_env(),
        )
        wait_until_ready(
            self._process,
            self.is_healthy,
            name="prefect server",
            log_path=log_path,
            timeout_s=SERVER_START_TIMEOUT_S,
            poll_s=0.5,
            stop=self.stop,
        )

    def stop(self) -> None:
        if self._process is not None:
            stop_process_group(self._process)
            self._process = None

    def __enter__(self) -> PrefectServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def run_prefect(
    env: Mapping[str, str], *args: str, timeout: float = 300.0
) -> subprocess.CompletedProcess[str]:
    """Run a `prefect ...` CLI command with env (a server's, see PrefectServer.env), from the
    project root."""
    result = subprocess.run(
        [_prefect_cli(), *args],
        env=dict(env),
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise SparkDeployError(
            f"`prefect {' '.join(args)}` exited with {result.returncode}:\n"
            f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )
    return result


def deployment_run(
    env: Mapping[str, str],
    deployment: str,
    parameters: Mapping[str, object],
    *,
    watch_timeout_s: float | None = None,
) -> str:
    """`prefect deployment run DEPLOYMENT --params JSON`, watched to its end when
    watch_timeout_s is given (an error if it does not complete); the flow run's id."""
    watch = ["--watch", "--watch-timeout", str(int(watch_timeout_s))] if watch_timeout_s else []
    result = run_prefect(
        env,
        "deployment",
        "run",
        deployment,
        "--params",
        json.dumps(dict(parameters)),
        *watch,
        timeout=(watch_timeout_s or 0) + 300,
    )
    found = FLOW_RUN_ID.search(result.stdout)
    if found is None:
        raise SparkDeployError(f"`prefect deployment run` named no flow run: {result.stdout}")
    return found.group(1)


def deploy_run(
    env: Mapping[str, str], recipe: str, cluster: str, *, watch_timeout_s: float | None = None
) -> str:
    """deploy/deploy of `recipe` on `cluster` (deployment_run)."""
    return deployment_run(
        env,
        "deploy/deploy",
        {"recipe": recipe, "cluster": cluster},
        watch_timeout_s=watch_timeout_s,
    )


def register_deployments(env: Mapping[str, str], names: Sequence[str] = ()) -> None:
    """The process work pool and the lab's deployments (lab/prefect.yaml: all, or those named),
    (re)created."""
    run_prefect(env, "work-pool", "create", WORK_POOL, "--type", "process", "--overwrite")
    selected = [arg for name in names for arg in ("--name", name)] or ["--all"]
    run_prefect(env, "deploy", *selected, "--no-prompt", "--prefect-file", str(LAB_PREFECT_FILE))


def register_flow(
    env: Mapping[str, str],
    entrypoint: str,
    name: str,
    parameters: Mapping[str, object],
    *,
    description: str,
    interval_s: int | None = None,
    collision_strategy: str = "CANCEL_NEW",
) -> str:
    """A deployment of the flow at `entrypoint` with `parameters`, one run at a time (Prefect's
    deployment concurrency limit 1: a run due while another runs is cancelled, CANCEL_NEW, or
    waits in AwaitingConcurrencySlot, ENQUEUE), every interval_s seconds when given; its full
    name."""
    schedule = ["--interval", str(interval_s)] if interval_s is not None else []
    run_prefect(
        env,
        "deploy",
        entrypoint,
        *("--name", name, "--pool", WORK_POOL, *schedule),
        *("--params", json.dumps(dict(parameters))),
        *("--concurrency-limit", "1", "--collision-strategy", collision_strategy),
        *("--description", description),
        *("--no-prompt", "--prefect-file", str(LAB_PREFECT_FILE)),
    )
    # The flow's name, not its function's (prefetch_all is the flow `prefetch-all`).
    flow_name = entrypoint.rpartition(":")[2].replace("_", "-")
    return f"{flow_name}/{name}"


def resume_schedules(env: Mapping[str, str], deployment: str) -> None:
    """Every schedule of `deployment` ("flow/name") on the server env names, turned on."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (
        temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}),
        get_client(sync_client=True) as client,
    ):
        found = client.read_deployment_by_name(deployment)
        for schedule in found.schedules:
            client.update_deployment_schedule(found.id, schedule.id, active=True)


def register_ensure(env: Mapping[str, str], recipe: str, cluster: str, *, interval_s: int) -> str:
    """A scheduled deploy of `recipe` with ensure semantics every interval_s seconds, its
    schedule on (prefect.yaml registers the same for a real cluster, its schedule off); its full
    name."""
    return register_flow(
        env,
        "flows/deploy.py:deploy",
        f"ensure-{recipe}",
        {"recipe": recipe, "cluster": cluster, "ensure": True},
        interval_s=interval_s,
        description=f"Keep {recipe} serving on {cluster} (ensure, every {interval_s} s)",
    )


def start_services(server: PrefectServer, log_path: Path) -> subprocess.Popen[bytes]:
    """Prefect's background services (scheduler, late runs, zombie detection, ...) as one
    process for every API server started with run_services False over the same database; stop
    it with stop_worker."""
    return start_logged(
        [_prefect_cli(), "server", "services", "start"],
        log_path,
        env=server.server_env(),
        cwd=PROJECT_ROOT,
    )


def start_worker(
    env: Mapping[str, str],
    log_path: Path,
    *,
    name: str | None = None,
    wrapper: Sequence[str] = (),
    limit: int | None = None,
) -> subprocess.Popen[bytes]:
    """A process worker polling the project's pool, named `name` when given, running at most
    `limit` flow runs at once when given; `wrapper` runs it elsewhere (Lab.on_ops_host: on an
    ops host). Stop it with stop_worker."""
    named = ["--name", name] if name else []
    named += ["--limit", str(limit)] if limit is not None else []
    return start_logged(
        [
            *wrapper,
            _prefect_cli(),
            *("worker", "start", "--pool", WORK_POOL, "--type", "process", *named),
        ],
        log_path,
        env=env,
        cwd=PROJECT_ROOT,
    )


def stop_worker(worker: subprocess.Popen[bytes]) -> None:
    stop_process_group(worker)
