"""Session fixtures shared by the test modules.

`prefect_harness` is one Prefect test server for the whole session (it takes about 20 s to
start), its state in a temporary PREFECT_HOME: Prefect's own test harness on SQLite, or with
SPARKDEPLOY_TEST_DATABASE=postgresql a server on a PostgreSQL database of its own (lab.postgres;
scripts/test runs the flow and lock tests that way too).

`lab_cluster` brings up one lab (3 nodes, named by SPARKDEPLOY_TEST_LAB, default "pytest") for
the whole session and tears it down at the end, checking that nothing of it remains. Where the
lab cannot run (not root, no namespaces, packages missing) its tests are skipped with the
reason, which `-ra` prints in the summary; in CI or as root such a skip fails (skip_policy.py).

The flow tests on the lab share a Prefect process worker (`worker`, one a module), the clean-up
after each test (`clean_lab_after`) and, for the fault matrix (tests/test_fault_matrix_*.py),
short retry delays (`short_retry_delays`) and one table of measured detection times for the
session (`matrix`), printed at the end of the pytest output.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path


def _free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


TEST_DATABASE = os.environ.get("SPARKDEPLOY_TEST_DATABASE", "sqlite")
if TEST_DATABASE == "postgresql":
    # Before Prefect is imported: its process-wide settings (what threads without the test's
    # settings context see) are read from the environment then.
    os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{_free_loopback_port()}/api"

import pytest
from lab_flows import (
    FAULT_MATRIX_TABLE,
    Matrix,
    Worker,
    harness_env,
    lab_brought_up,
    register_lab_deployments,
)
from readiness_lab import Deployment, cache_tiny_model

from lab.cluster import Lab
from lab.models import publish_lab_models
from lab.postgres import PostgresServer
from lab.prefect_local import SERVER_KEEPALIVE_S, PrefectServer, free_port, stop_worker
from lab.vllm_runtime import RealEngine, ensure_runtime, prepare_real_engine, unavailable_reason
from sparkdeploy.remote import ssh
from sparkdeploy.remote.targets import cluster_targets
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import lab_root
from sparkdeploy.steps.hold_nodes import holders, release_nodes
from sparkdeploy.steps.status import cluster_status
from sparkdeploy.steps.teardown import teardown as remove_deployment

pytest_plugins = ["skip_policy"]

TEST_LAB_NAME = os.environ.get("SPARKDEPLOY_TEST_LAB", "pytest")
TEST_LAB_NODES = 3


@pytest.fixture(scope="session")
def lab_cluster() -> Iterator[Lab]:
    with lab_brought_up(TEST_LAB_NAME, TEST_LAB_NODES) as lab:
        yield lab


@pytest.fixture(scope="session")
def lab_engine_image(lab_cluster: Lab) -> str:
    """`lab/vllm-standin:latest`, built from this checkout and pushed to the lab registry."""
    from lab.image import build_engine_image

    return build_engine_image(lab_cluster)


@pytest.fixture(scope="session")
def vllm_runtime() -> Path:
    """Real vLLM's CPU build, installed once per machine (cached under the lab root). Skipped,
    with the reason, only on a machine that cannot run the CPU build at all."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return ensure_runtime()


@pytest.fixture(scope="session")
def real_engine(lab_cluster: Lab, vllm_runtime: Path) -> RealEngine:
    """Real vLLM's CPU build on the lab: the root file system made once per machine (cached
    under the lab root), the image pushed to the lab registry, the model in the lab hub."""
    return prepare_real_engine(lab_cluster)


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("prefect-home")
    # Before Prefect reads its settings: results and local storage go under this home, and the
    # server never tries to send telemetry out of the machine.
    os.environ["PREFECT_HOME"] = str(home)
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    # The harness runs uvicorn with the environment it inherits; see SERVER_KEEPALIVE_S.
    os.environ["UVICORN_TIMEOUT_KEEP_ALIVE"] = str(SERVER_KEEPALIVE_S)
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    if TEST_DATABASE == "sqlite":
        with (
            temporary_settings({PREFECT_HOME: home}),
            prefect_test_harness(server_startup_timeout=120),
        ):
            yield home
        return
    if TEST_DATABASE != "postgresql":
        raise pytest.UsageError(
            f"SPARKDEPLOY_TEST_DATABASE={TEST_DATABASE!r}: choose sqlite (the default) or"
            " postgresql"
        )
    with PostgresServer(lab_root() / "postgres" / f"pytest-{os.getpid()}", free_port()) as database:
        try:
            database.create_database("prefect")
            port = int(os.environ["PREFECT_API_URL"].rsplit(":", 1)[1].split("/")[0])
            server = PrefectServer(home, port=port, database_url=database.database_url("prefect"))
            with (
                server,
                temporary_settings({PREFECT_HOME: home, PREFECT_API_URL: server.api_url}),
            ):
                yield home
        finally:
            database.remove()


@pytest.fixture(scope="module")
def cluster(lab_cluster: Lab, lab_engine_image: str) -> Iterator[str]:
    """The lab's inventory (a path: the flows take names or paths), with the lab models in its
    hub, for the flows on the stand-in engine."""
    publish_lab_models(lab_cluster.hub_repos_dir)
    yield str(lab_cluster.inventory_path)
    ssh.close_cached()


@pytest.fixture
def deployments(lab_cluster: Lab, lab_engine_image: str) -> Iterator[list[Deployment]]:
    """Engine containers a test starts (readiness_lab.Deployment); all removed afterwards."""
    cache_tiny_model(lab_cluster)
    started: list[Deployment] = []
    yield started
    for deployment in started:
        deployment.remove()
    assert not [name for d in started for name in d.remaining()]


@pytest.fixture
def clean_lab_after(lab_cluster: Lab, cluster: str) -> Iterator[None]:
    """Whatever a test left (it asserts there is nothing; a failed test may have stopped short
    of its own teardown) is removed by deployment id after it, so one failure does not
    cascade."""
    yield
    ssh.close_cached()
    inventory = load_cluster(Path(cluster))
    held = {h.deployment_id for h in holders(inventory.name, lab_cluster.nodes).values() if h}
    running = {status.deployment_id for status in cluster_status(inventory)}
    for deployment_id in held | running:
        remove_deployment(deployment_id, cluster_targets(inventory), inventory.nas.runs_dir)
        release_nodes(inventory.name, lab_cluster.nodes, deployment_id)


@pytest.fixture(scope="module")
def worker(
    cluster: str, prefect_harness: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    """A process worker on the session's Prefect server for deploy/deploy, started when a test
    first submits a run; stopped after the module."""
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


# The fault matrix's retried tasks wait this long between attempts (field: tasks/*.py's
# schedules).
RETRY_DELAY_S = 1.0


@pytest.fixture
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


@pytest.fixture(scope="session")
def matrix(lab_cluster: Lab, request: pytest.FixtureRequest) -> Iterator[Matrix]:
    """The fault matrix's table for the session, whichever of its modules ran: written to
    <lab root>/fault-matrix-<lab>.md and kept for the end of the pytest output."""
    measured = Matrix()
    yield measured
    if measured.rows:
        path = lab_root() / f"fault-matrix-{lab_cluster.name}.md"
        path.write_text(measured.table())
        request.config.stash[FAULT_MATRIX_TABLE] = (str(path), measured.table())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The fault matrix's measured detection times, when its tests ran."""
    measured = terminalreporter.config.stash.get(FAULT_MATRIX_TABLE, None)
    if measured is not None:
        path, table = measured
        terminalreporter.write_sep("=", f"fault matrix (also in {path})")
        terminalreporter.write(table)
