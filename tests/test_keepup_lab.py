"""Keeping deployments up on the lab, through a full Prefect server (its scheduler, triggers and
actions services; the test harness runs no scheduler) and a process worker:

- a scheduled deploy with ensure semantics, firing every few seconds: the first run deploys, the
  next ones only smoke-test, and once the engine is killed the next one redeploys it;
- the watchdog, on a short schedule, finds a deployment whose engine died after ready
  (recipes/lab-dies-once), its unhealthy event reaches a notification block (a webhook this
  test listens on) and the repair automation of prefect.yaml, which redeploys it once;
- the same chain with real vLLM on two nodes whose worker container is killed.
The run history of each is printed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from lab_flows import answers_the_canary, nothing_runs, task_history

from flows.teardown import teardown
from lab.cluster import Lab
from lab.models import publish_lab_models
from lab.prefect_local import (
    PrefectServer,
    deploy_run,
    free_port,
    register_deployments,
    register_ensure,
    register_flow,
    run_prefect,
    start_worker,
    stop_worker,
)
from lab.testing.waiting import wait_for
from lab.vllm_runtime import RealEngine
from sparkdeploy.remote.ssh import cached_connection, close_cached
from sparkdeploy.remote.targets import node_target
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import load_plan
from sparkdeploy.steps.status import cluster_status

pytestmark = [pytest.mark.lab]

# Short schedules, so that each test sees several runs; a run due while the last one still goes
# is cancelled (register_flow).
ENSURE_INTERVAL_S = 20
WATCHDOG_INTERVAL_S = 20


class Webhook:
    """An HTTP endpoint on loopback that keeps the JSON bodies POSTed to it."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                received.append(json.loads(self.rfile.read(length) or b"{}"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/notify"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def cluster(lab_cluster: Lab, lab_engine_image: str) -> Iterator[str]:
    publish_lab_models(lab_cluster.hub_repos_dir)
    yield str(lab_cluster.inventory_path)
    close_cached()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """`prefect server start` of its own, the `deploy` deployment (with prefect.yaml's repair
    trigger) registered, and a worker; the in-process Prefect calls of these tests go to it."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogHandler
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path_factory.mktemp("prefect-server")
    running = PrefectServer(home, port=free_port())
    running.start()
    worker = None
    try:
        with temporary_settings({PREFECT_API_URL: running.api_url}):
            # Only `deploy`: prefect.yaml's own schedules (the 30-minute watchdog, the nightly
            # prefetch) name the cluster `lab`, which is not this test's.
            register_deployments(running.env(), names=["deploy"])
            worker = start_worker(running.env(), home / "worker.log")
            yield running
    finally:
        if worker is not None:
            stop_worker(worker)
            print((home / "worker.log").read_text()[-3000:])
        # What the in-process flows still send goes out before the server does.
        APILogHandler().flush()
        EventsWorker.drain_all()
        running.stop()


def runs_of(deployment: str) -> list[Any]:
    """The deployment's flow runs, oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    name = deployment.split("/")[1]
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[name])),
            limit=200,
        )
    return sorted(
        (run for run in runs if run.state is not None and not run.state.is_scheduled()),
        key=started,
    )


def runs_since(deployment: str, since: datetime) -> list[Any]:
    """The deployment's runs that started (or were due) at `since` or later: this test's, not
    an earlier test's on the same server."""
    return [run for run in runs_of(deployment) if started(run) >= since]


def started(run: Any) -> datetime:
    """When the run started, or was due to (a cancelled one never started)."""
    moment: datetime = run.start_time or run.expected_start_time
    return moment


def booted(run: Any) -> bool:
    """Whether the run started containers (else it did nothing beyond its checks)."""
    return any(line.startswith("boot ") for line in task_history(str(run.id), settled=True))


# How long a test waits for each link of its chain (a run, a repair, a notification), and how
# often it looks.
CHAIN_TIMEOUT_S = 900.0
CHAIN_POLL_S = 3.0


def stop_schedule(env: dict[str, str], deployment: str) -> None:
    """No more runs of it: its schedule cleared, those already due cancelled, the running one
    awaited."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled

    run_prefect(env, "deployment", "schedule", "clear", deployment, "-y")
    with get_client(sync_client=True) as client:

        def pending() -> list[Any]:
            return client.read_flow_runs(
                deployment_filter=DeploymentFilter(
                    name=DeploymentFilterName(any_=[deployment.split("/")[1]])
                ),
                flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(
                        type=FlowRunFilterStateType(
                            any_=[StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING]
                        )
                    )
                ),
            )

        for run in pending():
            if run.state is not None and run.state.type != StateType.RUNNING:
                client.set_flow_run_state(run.id, Cancelled(), force=True)
        wait_for(
            f"end of the runs of {deployment}",
            lambda: not pending(),
            timeout_s=CHAIN_TIMEOUT_S,
            poll_s=CHAIN_POLL_S,
        )


def history_line(run: Any, since: datetime) -> str:
    tags = ", ".join(tag for tag in run.tags if tag in ("repair",))
    return (
        f"+{(started(run) - since).total_seconds():6.1f} s  {run.name:<45} {run.state.name:<10}"
        + (f" [{tags}]" if tags else "")
        + (f"  {run.state.message.splitlines()[0][:110]}" if run.state.message else "")
    )


def kill_container(cluster: str, recipe: str) -> None:
    head = load_plan(recipe, cluster).nodes[0]
    cached_connection(node_target(head)).run(["docker", "kill", head.container.name], timeout=60)


def healthy_alone(cluster: str, recipe: str) -> bool:
    """The recipe's deployment is the only one on the cluster and its head is healthy."""
    plan = load_plan(recipe, cluster)
    statuses = cluster_status(load_cluster(Path(cluster)))
    return [(s.deployment_id, s.healthy) for s in statuses] == [(plan.deployment_id, True)]


def serves(cluster: str, recipe: str) -> bool:
    return healthy_alone(cluster, recipe) and answers_the_canary(
        load_plan(recipe, cluster).endpoint
    )


def test_a_scheduled_ensure_deploy_is_a_smoke_test_while_it_serves_and_a_repair_when_not(
    cluster: str, server: PrefectServer
) -> None:
    env = server.env()
    ensure = register_ensure(env, "lab-single", cluster, interval_s=ENSURE_INTERVAL_S)
    since = datetime.now().astimezone()
    try:

        def completed() -> list[Any]:
            return [run for run in runs_of(ensure) if run.state.is_completed()]

        first = wait_for(
            "deploying run", lambda: completed()[:1], timeout_s=CHAIN_TIMEOUT_S, poll_s=CHAIN_POLL_S
        )[0]
        assert booted(first), task_history(str(first.id))
        noop = wait_for(
            "run after the first",
            lambda: completed()[1:2],
            timeout_s=CHAIN_TIMEOUT_S,
            poll_s=CHAIN_POLL_S,
        )[0]
        assert not booted(noop), task_history(str(noop.id))
        assert serves(cluster, "lab-single")
        kill_container(cluster, "lab-single")
        killed_at = len(completed())
        repair = wait_for(
            "run that repairs it",
            lambda: [run for run in completed()[killed_at:] if booted(run)],
            timeout_s=CHAIN_TIMEOUT_S,
            poll_s=CHAIN_POLL_S,
        )[0]
        assert serves(cluster, "lab-single")
    finally:
        stop_schedule(env, ensure)
        print(f"\nrun history of {ensure}:")
        for run in runs_of(ensure):
            print(history_line(run, since), "(booted)" if booted(run) else "")
        teardown("lab-single", cluster=cluster)
    assert repair.expected_start_time > noop.expected_start_time
    nothing_runs(cluster)


def watch_until_repaired(
    env: dict[str, str], cluster: str, recipe: str, *, fault: Callable[[], None] | None = None
) -> tuple[Any, Any, datetime]:
    """`recipe` deployed through the worker, the watchdog scheduled every few seconds, then
    `fault` (None: the recipe brings its own); returns the repair run and the first watchdog
    run that found the deployment down, once a healthy watchdog run follows the repair. The
    chain's run history is printed; the watchdog's schedule is stopped and the recipe torn
    down whatever happens."""
    since = datetime.now().astimezone()
    watchdog = "smoke/watchdog-test"
    try:
        deploy_run(env, recipe, cluster, watch_timeout_s=900)
        register_flow(
            env,
            "flows/smoke.py:smoke",
            "watchdog-test",
            {"cluster": cluster},
            interval_s=WATCHDOG_INTERVAL_S,
            description="The smoke watchdog of the test lab, every few seconds",
        )
        if fault is not None:
            fault()

        def repaired() -> list[Any]:
            return [
                run
                for run in runs_since("deploy/deploy", since)
                if "repair" in run.tags and run.state.is_completed() and booted(run)
            ]

        repair = wait_for("repair run", repaired, timeout_s=CHAIN_TIMEOUT_S, poll_s=CHAIN_POLL_S)[0]
        wait_for(
            "healthy watchdog run after the repair",
            lambda: [
                run
                for run in runs_since(watchdog, since)
                if run.state.is_completed() and run.start_time > repair.end_time
            ],
            timeout_s=CHAIN_TIMEOUT_S,
            poll_s=CHAIN_POLL_S,
        )
        # That watchdog run's smoke test asked the canaries: it answers again.
        assert healthy_alone(cluster, recipe)
    finally:
        stop_schedule(env, watchdog)
        try:
            # A repair still going would boot its containers after the teardown, and leave them
            # to the next test: its end is waited for first.
            wait_for(
                "the end of every deploy run",
                lambda: all(run.state.is_final() for run in runs_since("deploy/deploy", since)),
                timeout_s=CHAIN_TIMEOUT_S,
                poll_s=CHAIN_POLL_S,
            )
            chain = sorted(
                runs_since("deploy/deploy", since) + runs_since(watchdog, since), key=started
            )
            print(f"\nrun history of the recovery of {recipe}:")
            deploys = {run.id for run in runs_of("deploy/deploy")}
            for run in chain:
                did = ""
                if run.id in deploys and run.state.is_completed():
                    did = "(booted)" if booted(run) else "(already serving: nothing done)"
                print(history_line(run, since), did)
        finally:
            teardown(recipe, cluster=cluster)
    # The chain, in order: the deploy, the watchdog run that found it down (the first one after
    # it died: within one interval), the one repair, a healthy watchdog run.
    chain_deploys = runs_since("deploy/deploy", since)
    assert [("repair" in run.tags, run.state.name) for run in chain_deploys if booted(run)] == [
        (False, "Completed"),
        (True, "Completed"),
    ]
    watched = [run for run in runs_since(watchdog, since) if not run.state.is_cancelled()]
    first_down = next(i for i, run in enumerate(watched) if run.state.is_failed())
    # The run before it found it healthy: it was noticed within one interval of its death.
    assert all(run.state.is_completed() for run in watched[:first_down])
    assert watched[first_down].end_time < repair.start_time
    assert recipe in watched[first_down].state.message
    return repair, watched[first_down], since


def test_the_watchdog_event_and_the_automation_recover_a_deployment_that_died(
    cluster: str, server: PrefectServer
) -> None:
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client

    from sparkdeploy.report.notify import apply_notify_automation

    env = server.env()
    webhook = Webhook()
    CustomWebhookNotificationBlock(
        name="the test's webhook",
        url=webhook.url,
        json_data={"subject": "{{subject}}", "body": "{{body}}"},
    ).save("keepup-test", overwrite=True)
    with get_client(sync_client=True) as client:
        apply_notify_automation(client, "custom-webhook/keepup-test")
    plan = load_plan("lab-dies-once", cluster)
    head = plan.nodes[0]
    # Armed: the fault strikes the first engine started on the node from now on.
    cached_connection(node_target(head)).run(["rm", "-rf", "/root/standin-faults"], timeout=60)
    try:
        watch_until_repaired(env, cluster, "lab-dies-once")
        wait_for(
            "notification", lambda: webhook.received, timeout_s=CHAIN_TIMEOUT_S, poll_s=CHAIN_POLL_S
        )
    finally:
        webhook.close()
    [notified, *_] = webhook.received
    print("notification:", json.dumps(notified, indent=2))
    assert plan.deployment_id in notified["subject"]
    assert "Cause (" in notified["body"]
    assert "node1" in notified["body"]
    nothing_runs(cluster)


@pytest.mark.real_engine
def test_the_chain_recovers_a_real_engine_whose_worker_was_killed(
    cluster: str, server: PrefectServer, real_engine: RealEngine
) -> None:
    """Real vLLM on two nodes: node2's worker container killed; the head's /health stays 200,
    the watchdog's real requests find it, name node2, and the repair redeploys it."""
    plan = load_plan("real-lab-2x", cluster)
    worker = plan.nodes[1]

    def kill_the_worker() -> None:
        cached_connection(node_target(worker)).run(
            ["docker", "kill", worker.container.name], timeout=60
        )

    _, found_down, _ = watch_until_repaired(
        server.env(), cluster, "real-lab-2x", fault=kill_the_worker
    )
    assert "node2" in found_down.state.message, found_down.state.message
    nothing_runs(cluster)
