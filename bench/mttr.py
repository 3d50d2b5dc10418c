"""Time to repair with the sentinel (issue 24.2): per fault, the time from the fault to the
sentinel's unhealthy event, from the event to the repair run's start, and to the endpoint
answering the canary again, against the targets (detect <= 15 s; serving again <= detect + the
recipe's cold deploy + 15 s); the probe's cost (CPU on this ops host and requests to the Prefect
server, per deployment per hour); and a soak: minutes of healthy serving under load, with the
events it raised (none is the target).

A 3-node lab, a Prefect server of its own with its services (the repair trigger of
lab/prefect.yaml's `deploy` acts on the event) and a process worker polling as pyproject.toml's
[tool.prefect.worker] says (every 2 s, as a team's worker started in the checkout does); the
sentinel's logic runs in this process (as its flow's task would). Faults, each on a deployment
of its own (the repair budget is per deployment): the head of recipes/lab-single killed
(node1), the worker of recipes/lab-pair killed (node2-3), and node3's link down for 30 s (back
before the grace: no event, no repair) and for 60 s (declared after the 45 s grace: repaired),
each on lab-single on node3, and an engine that starts failing requests after ready
(recipes/lab-fails-requests: /health stays 200). With --real, also real vLLM's worker killed
(recipes/real-lab-2x on node2-3: its runtime, image and model prepared as by the demo). Needs
root.

    .venv/bin/python -m bench.mttr [--lab benchmttr] [--faults "head killed,link down 60 s"]
        [--no-cpu] [--real] [--soak-minutes 20]
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun


from lab.prefect_local import (
    PrefectServer,
    free_port,
    register_deployments,
    start_worker,
    stop_worker,
)

# Before Prefect is imported: its process-wide settings, which the threads Prefect starts
# itself (outside any settings context) go by, name this bench's server.
PREFECT_PORT = free_port()
os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{PREFECT_PORT}/api"

from lab.cluster import Lab  # noqa: E402
from lab.image import build_engine_image  # noqa: E402
from lab.models import publish_lab_models  # noqa: E402
from lab.testing.engine_chat import chat  # noqa: E402
from lab.testing.waiting import wait_for  # noqa: E402
from lab.vllm_runtime import prepare_real_engine  # noqa: E402
from sparkdeploy.remote.ssh import cached_connection  # noqa: E402
from sparkdeploy.remote.targets import node_target  # noqa: E402
from sparkdeploy.spec.cluster import Cluster, load_cluster  # noqa: E402
from sparkdeploy.spec.plan import Plan  # noqa: E402
from sparkdeploy.spec.project import load_plan  # noqa: E402
from sparkdeploy.steps.repair_budget import REPAIR_TAG  # noqa: E402
from sparkdeploy.steps.sentinel import UNREACHABLE_GRACE_S, ProbeResult, run_sentinel  # noqa: E402
from tasks.sentinel import PrefectReporter, watched_plans  # noqa: E402

CANARY = ("What is 127*43?", "5461")
FAIL_REQUESTS_SWITCH = "/tmp/standin-fail-requests"  # recipes/lab-fails-requests
DETECT_TARGET_S = 15.0
# Serving again within detect + the recipe's cold deploy + this.
SERVE_MARGIN_S = 15.0
PHASE_TIMEOUT_S = 300.0
# How often a phase's end is looked for: the resolution of the times measured.
PHASE_POLL_S = 0.2
# After a link is back, how long an event would still count as the link's fault.
QUIET_AFTER_S = UNREACHABLE_GRACE_S + 15.0
# The sentinel reads the cluster every 30 s: a new deployment is watched within that.
WATCHED_TIMEOUT_S = 45.0
CPU_WINDOW_S = 60.0


class Reporter(PrefectReporter):
    """The flow's reporter, also noting when each deployment was first watched and declared."""

    def __init__(self, cluster: str, inventory: Cluster) -> None:
        super().__init__(cluster, inventory, logging.getLogger("sentinel"))
        self.watched: set[str] = set()
        self.declared: dict[str, float] = {}  # deployment id -> time.time() of its event

        self.events = 0  # emitted, of either kind

    def unhealthy(self, plan: Plan, result: ProbeResult, cause: str) -> None:
        super().unhealthy(plan, result, cause)
        self.events += 1
        self.declared.setdefault(plan.deployment_id, time.time())

    def recovered(self, plan: Plan) -> None:
        super().recovered(plan)
        self.events += 1

    def log(self, message: str) -> None:
        super().log(message)
        deployment_id, _, rest = message.partition(": ")
        if rest.startswith("watched"):
            self.watched.add(deployment_id)
        elif rest.startswith("gone"):
            # Torn down: the same deployment deployed again is watched anew.
            self.watched.discard(deployment_id)

    def wait_until_watching(self, plan: Plan) -> None:
        """Until the sentinel watches the plan's deployment (it reads the cluster every 30 s)."""
        wait_for(
            "watch",
            lambda: plan.deployment_id in self.watched,
            timeout_s=WATCHED_TIMEOUT_S,
            poll_s=PHASE_POLL_S,
        )


@dataclass(frozen=True)
class Fault:
    name: str
    recipe: str
    nodes: list[str]
    inject: Callable[[Lab, Plan], None]  # returns once the fault is in (or over, for a link)
    repaired: bool  # whether a repair is expected
    # An unreachable node is declared only after the grace a link gets to come back.
    detect_target_s: float = DETECT_TARGET_S


def kill(rank: int) -> Callable[[Lab, Plan], None]:
    def inject(lab: Lab, plan: Plan) -> None:
        node = plan.nodes[rank]
        cached_connection(node_target(node)).run(
            ["docker", "kill", node.container.name], timeout=60
        )

    return inject


def fail_requests(lab: Lab, plan: Plan) -> None:
    """The stand-in's fail_requests switch thrown: every completion answers 500 from now on."""
    head = plan.nodes[0]
    cached_connection(node_target(head)).run(
        ["docker", "exec", head.container.name, "touch", FAIL_REQUESTS_SWITCH], timeout=60
    )


def link_down(for_s: float) -> Callable[[Lab, Plan], None]:
    """The node's port on the lab bridge down (no FIN, no RST), in the background for for_s."""

    def inject(lab: Lab, plan: Plan) -> None:
        port = [
            *("ip", "-n", lab.layout.bridge_netns, "link", "set"),
            lab.layout.node_bridge_port(plan.head.node),
        ]
        subprocess.run([*port, "down"], check=True, timeout=10)

        def back() -> None:
            time.sleep(for_s)
            subprocess.run([*port, "up"], check=True, timeout=10)

        threading.Thread(target=back, daemon=True).start()

    return inject


FAULTS = [
    Fault("head killed", "lab-single", ["node1"], kill(0), True),
    Fault("worker killed", "lab-pair", ["node2", "node3"], kill(1), True),
    Fault("link down 30 s", "lab-single", ["node3"], link_down(30), False),
    Fault(
        "link down 60 s",
        "lab-single",
        ["node3"],
        link_down(60),
        True,
        UNREACHABLE_GRACE_S + DETECT_TARGET_S,
    ),
    Fault("engine fails requests", "lab-fails-requests", ["node1"], fail_requests, True),
]
REAL_FAULTS = [Fault("real vLLM worker killed", "real-lab-2x", ["node2", "node3"], kill(1), True)]


def answers_canary(plan: Plan) -> bool:
    try:
        reply = chat(
            plan.endpoint,
            plan.served_model_name,
            CANARY[0],
            timeout_s=5,
            # The lab recipes' short reasoning: glm45's default thinking uses up the reply.
            chat_template_kwargs={"reasoning_effort": "low"},
        )
    except OSError:
        return False
    return reply.status == 200 and CANARY[1] in reply.body.decode(errors="replace")


def repair_runs(plan: Plan, since: datetime) -> list[FlowRun]:
    """The repair runs (a `repair_cause`: the automation's) of the plan's deployment started
    since `since`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[f"deployment:{plan.deployment_id}"])
            )
        )
    return [
        run
        for run in runs
        if run.parameters.get("repair_cause")
        and run.start_time is not None
        and run.start_time >= since
    ]


def measure(lab: Lab, cluster: str, reporter: Reporter, fault: Fault) -> str:
    from flows.deploy import deploy
    from flows.teardown import teardown

    plan = load_plan(fault.recipe, cluster, fault.nodes)
    reporter.declared.pop(plan.deployment_id, None)
    wait_for(
        "the last watch's end",
        lambda: plan.deployment_id not in reporter.watched,
        timeout_s=PHASE_TIMEOUT_S,
        poll_s=PHASE_POLL_S,
    )
    started = time.monotonic()
    deploy(fault.recipe, cluster=cluster, nodes=fault.nodes)
    deploy_s = time.monotonic() - started
    try:
        reporter.wait_until_watching(plan)
        time.sleep(10)  # a few good probes first
        since = datetime.now(UTC)
        fault_at = time.time()
        fault.inject(lab, plan)
        if not fault.repaired:
            time.sleep(30)
            wait_for(
                "canary",
                lambda: answers_canary(plan),
                timeout_s=PHASE_TIMEOUT_S,
                poll_s=PHASE_POLL_S,
            )
            back_s = time.time() - fault_at
            time.sleep(QUIET_AFTER_S)
            events = "an event (false alarm)" if plan.deployment_id in reporter.declared else "none"
            return f"{fault.name}: canary answered at {back_s:.1f} s; events: {events}"
        wait_for(
            "unhealthy event",
            lambda: plan.deployment_id in reporter.declared,
            timeout_s=PHASE_TIMEOUT_S,
            poll_s=PHASE_POLL_S,
        )
        event_s = reporter.declared[plan.deployment_id] - fault_at
        wait_for(
            "repair run",
            lambda: repair_runs(plan, since),
            timeout_s=PHASE_TIMEOUT_S,
            poll_s=PHASE_POLL_S,
        )
        repair = repair_runs(plan, since)[0]
        assert repair.start_time is not None
        repair_s = repair.start_time.timestamp() - fault_at
        wait_for(
            "canary", lambda: answers_canary(plan), timeout_s=PHASE_TIMEOUT_S, poll_s=PHASE_POLL_S
        )
        canary_s = time.time() - fault_at
        wait_for(
            "the repair's end",
            lambda: all(r.state and r.state.is_final() for r in repair_runs(plan, since)),
            timeout_s=PHASE_TIMEOUT_S,
            poll_s=PHASE_POLL_S,
        )
        did = ", ".join(
            "redeployed" if REPAIR_TAG in run.tags else "found it serving, did nothing"
            for run in repair_runs(plan, since)
        )
        serve_bound_s = event_s + deploy_s + SERVE_MARGIN_S
        detect = "ok" if event_s <= fault.detect_target_s else "MISSED"
        serving = "ok" if canary_s <= serve_bound_s else "MISSED"
        verdict = (
            f"detect {detect} (<= {fault.detect_target_s:.0f} s), serving again {serving} (<="
            f" {serve_bound_s:.1f} s: detect + its deploy's {deploy_s:.1f} s"
            f" + {SERVE_MARGIN_S:.0f})"
        )
        return (
            f"{fault.name}: event {event_s:.1f} s after the fault; repair run started"
            f" {repair_s - event_s:.1f} s after the event ({did}); canary answered"
            f" {canary_s:.1f} s after the fault; {verdict}"
        )
    finally:
        time.sleep(5)  # the repair run's last states
        teardown(fault.recipe, cluster=cluster, nodes=fault.nodes)


@contextmanager
def prefect_requests() -> Iterator[list[str]]:
    """Every request this process sends to the Prefect server (its clients are httpx ones;
    events go over a websocket and are counted by the reporter) while inside."""
    import httpx

    api = urlsplit(os.environ["PREFECT_API_URL"]).netloc
    sent: list[str] = []
    sync_send, async_send = httpx.Client.send, httpx.AsyncClient.send

    def note(request: httpx.Request) -> None:
        if request.url.netloc.decode() == api:
            sent.append(f"{request.method} {request.url.path}")

    def counted_sync(self: httpx.Client, request: httpx.Request, **options: Any) -> Any:
        note(request)
        return sync_send(self, request, **options)

    async def counted_async(self: httpx.AsyncClient, request: httpx.Request, **options: Any) -> Any:
        note(request)
        return await async_send(self, request, **options)

    httpx.Client.send = counted_sync  # type: ignore[method-assign]
    httpx.AsyncClient.send = counted_async  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        httpx.Client.send = sync_send  # type: ignore[method-assign]
        httpx.AsyncClient.send = async_send  # type: ignore[method-assign]


def probe_cost(cluster: str, reporter: Reporter) -> str:
    """The process's CPU and its requests to the Prefect server while the sentinel watches one
    serving deployment and nothing else runs here: per deployment per hour."""
    from flows.deploy import deploy
    from flows.teardown import teardown

    plan = load_plan("lab-single", cluster, ["node1"])
    deploy("lab-single", cluster=cluster, nodes=["node1"])
    try:
        reporter.wait_until_watching(plan)
        events = reporter.events
        with prefect_requests() as sent:
            cpu = time.process_time()
            time.sleep(CPU_WINDOW_S)
            cpu = time.process_time() - cpu
        events = reporter.events - events
    finally:
        teardown("lab-single", cluster=cluster, nodes=["node1"])
    per_hour = 3600 / CPU_WINDOW_S
    kinds = ", ".join(sorted(set(sent))) or "none"
    return (
        f"probe cost: {cpu:.2f} CPU s over {CPU_WINDOW_S:.0f} s for one deployment:"
        f" {cpu * per_hour:.0f} CPU s an hour per deployment on the ops host; the Prefect"
        f" server: {len(sent)} requests and {events} events in the window,"
        f" {len(sent) * per_hour:.0f} requests an hour per deployment ({kinds})"
    )


def soak(cluster: str, reporter: Reporter, recipe: str, nodes: list[str], minutes: float) -> str:
    """Healthy serving under the benchmark's load (two clients asking back to back) for
    `minutes`, watched: the events raised (the target is none) and the load's answers."""
    from flows.deploy import deploy
    from flows.teardown import teardown

    plan = load_plan(recipe, cluster, nodes)
    deploy(recipe, cluster=cluster, nodes=nodes)
    stop = threading.Event()
    answered = [0, 0]  # good, bad

    def load() -> None:
        while not stop.is_set():
            answered[0 if answers_canary(plan) else 1] += 1

    loaders = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    try:
        reporter.wait_until_watching(plan)
        events = reporter.events
        for loader in loaders:
            loader.start()
        time.sleep(minutes * 60)
        events = reporter.events - events
    finally:
        stop.set()
        for loader in loaders:
            loader.join(timeout=30)
        teardown(recipe, cluster=cluster, nodes=nodes)
    verdict = "ok" if events == 0 else "FALSE ALARM"
    return (
        f"soak: {recipe}, {minutes:.0f} min under load ({answered[0]} canaries answered,"
        f" {answered[1]} not): {events} events ({verdict}; target none)"
    )


@contextmanager
def prefect(lab: Lab) -> Iterator[None]:
    workdir = lab.layout.state_dir / "bench-mttr"
    server = PrefectServer(workdir / "prefect", port=PREFECT_PORT)
    server.start()
    worker = None
    try:
        register_deployments(server.env(), ["deploy"])
        worker = start_worker(
            {k: v for k, v in server.env().items() if k != "PREFECT_WORKER_QUERY_SECONDS"},
            workdir / "worker.log",
        )
        yield
    finally:
        if worker is not None:
            stop_worker(worker)
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--lab", default="benchmttr")
    parser.add_argument(
        "--faults",
        default=",".join(fault.name for fault in FAULTS),
        help="which faults, by name, comma-separated (default: all)",
    )
    parser.add_argument("--no-cpu", action="store_true", help="skip the probe's cost window")
    parser.add_argument(
        "--real", action="store_true", help="also real vLLM (CPU build): a worker of real-lab-2x"
    )
    parser.add_argument(
        "--soak-minutes",
        type=float,
        default=0.0,
        help="then serve under load this long, watched (lab-single; real-lab-2x with --real)",
    )
    options = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    lab = Lab(options.lab, 3)
    lab.up()
    try:
        build_engine_image(lab)
        publish_lab_models(lab.hub_repos_dir)
        if options.real:
            prepare_real_engine(lab)
        cluster = str(lab.inventory_path)
        inventory = load_cluster(lab.inventory_path)
        with prefect(lab):
            reporter = Reporter(cluster, inventory)
            threading.Thread(
                target=run_sentinel,
                args=(lambda: watched_plans(inventory), reporter),
                kwargs={"run_for_s": 24 * 3600.0},
                daemon=True,
            ).start()
            lines = [] if options.no_cpu else [probe_cost(cluster, reporter)]
            print(*lines, flush=True)
            chosen = options.faults.split(",")
            faults = [fault for fault in FAULTS if fault.name in chosen]
            for fault in faults + (REAL_FAULTS if options.real else []):
                lines.append(measure(lab, cluster, reporter, fault))
                print(lines[-1], flush=True)
            if options.soak_minutes:
                recipe, nodes = (
                    ("real-lab-2x", ["node2", "node3"])
                    if options.real
                    else (
                        "lab-single",
                        ["node1"],
                    )
                )
                lines.append(soak(cluster, reporter, recipe, nodes, options.soak_minutes))
                print(lines[-1], flush=True)
        print("\n".join(["", "mttr:", *lines]))
    finally:
        lab.down()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
