"""Time to repair with the sentinel (issue 24.2, a first cut): per fault, the time from the
fault to the sentinel's unhealthy event, from the event to the repair run's start, and to the
endpoint answering the canary again; and the probe's CPU on this (ops) host.

A 3-node lab, a Prefect server of its own with its services (the repair trigger of
lab/prefect.yaml's `deploy` acts on the event) and a process worker polling every second; the
sentinel's logic runs in this process (as its flow's task would). Faults, each on a deployment
of its own (the repair budget is per deployment): the head of recipes/lab-single killed
(node1), the worker of recipes/lab-pair killed (node2-3), and node3's link down for 30 s (back
before the grace: no event, no repair) and for 60 s (declared after the 45 s grace: repaired),
each on lab-single on node3. An engine that starts failing requests is not measured here yet:
the stand-in has no switch that turns on after ready. Needs root.

    .venv/bin/python bench/mttr.py [--lab benchmttr] [--faults "head killed,link down 60 s"]
        [--no-cpu]
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:1] = [str(REPO_ROOT)]

from lab.prefect_local import (  # noqa: E402
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
from sparkdeploy.remote import engine_http  # noqa: E402
from sparkdeploy.remote.ssh import cached_connection  # noqa: E402
from sparkdeploy.remote.targets import node_target  # noqa: E402
from sparkdeploy.spec.cluster import Cluster, load_cluster  # noqa: E402
from sparkdeploy.spec.plan import Plan  # noqa: E402
from sparkdeploy.spec.project import load_plan  # noqa: E402
from sparkdeploy.steps.repair_budget import REPAIR_TAG  # noqa: E402
from sparkdeploy.steps.sentinel import UNREACHABLE_GRACE_S, ProbeResult, run_sentinel  # noqa: E402
from tasks.sentinel import PrefectReporter, watched_plans  # noqa: E402

CANARY = ("What is 127*43?", "5461")
PHASE_TIMEOUT_S = 300.0
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

    def unhealthy(self, plan: Plan, result: ProbeResult, cause: str) -> None:
        super().unhealthy(plan, result, cause)
        self.declared.setdefault(plan.deployment_id, time.time())

    def log(self, message: str) -> None:
        super().log(message)
        deployment_id, _, rest = message.partition(": ")
        if rest.startswith("watched"):
            self.watched.add(deployment_id)
        elif rest.startswith("gone"):
            # Torn down: the same deployment deployed again is watched anew.
            self.watched.discard(deployment_id)


@dataclass(frozen=True)
class Fault:
    name: str
    recipe: str
    nodes: list[str]
    inject: Callable[[Lab, Plan], None]  # returns once the fault is in (or over, for a link)
    repaired: bool  # whether a repair is expected


def kill(rank: int) -> Callable[[Lab, Plan], None]:
    def inject(lab: Lab, plan: Plan) -> None:
        node = plan.nodes[rank]
        cached_connection(node_target(node)).run(
            ["docker", "kill", node.container.name], timeout=60
        )

    return inject


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
    Fault("link down 60 s", "lab-single", ["node3"], link_down(60), True),
]


def answers_canary(plan: Plan) -> bool:
    try:
        reply = engine_http.request(
            "POST",
            f"{plan.endpoint}/v1/chat/completions",
            timeout=5,
            json_body={
                "model": plan.served_model_name,
                "messages": [{"role": "user", "content": CANARY[0]}],
                # The lab recipes' short reasoning: glm45's default thinking uses up the reply.
                "chat_template_kwargs": {"reasoning_effort": "low"},
            },
        )
    except OSError:
        return False
    return reply.status == 200 and CANARY[1] in reply.body.decode(errors="replace")


def wait_for(
    what: str, condition: Callable[[], object], timeout_s: float = PHASE_TIMEOUT_S
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.2)


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
    wait_for("the last watch's end", lambda: plan.deployment_id not in reporter.watched)
    deploy(fault.recipe, cluster=cluster, nodes=fault.nodes)
    try:
        wait_for("watch", lambda: plan.deployment_id in reporter.watched, WATCHED_TIMEOUT_S)
        time.sleep(10)  # a few good probes first
        since = datetime.now(UTC)
        fault_at = time.time()
        fault.inject(lab, plan)
        if not fault.repaired:
            time.sleep(30)
            wait_for("canary", lambda: answers_canary(plan))
            back_s = time.time() - fault_at
            time.sleep(QUIET_AFTER_S)
            events = "an event (false alarm)" if plan.deployment_id in reporter.declared else "none"
            return f"{fault.name}: canary answered at {back_s:.1f} s; events: {events}"
        wait_for("unhealthy event", lambda: plan.deployment_id in reporter.declared)
        event_s = reporter.declared[plan.deployment_id] - fault_at
        wait_for("repair run", lambda: repair_runs(plan, since))
        repair = repair_runs(plan, since)[0]
        assert repair.start_time is not None
        repair_s = repair.start_time.timestamp() - fault_at
        wait_for("canary", lambda: answers_canary(plan))
        canary_s = time.time() - fault_at
        wait_for(
            "the repair's end",
            lambda: all(r.state and r.state.is_final() for r in repair_runs(plan, since)),
        )
        did = ", ".join(
            "redeployed" if REPAIR_TAG in run.tags else "found it serving, did nothing"
            for run in repair_runs(plan, since)
        )
        return (
            f"{fault.name}: event {event_s:.1f} s after the fault; repair run started"
            f" {repair_s - event_s:.1f} s after the event ({did}); canary answered"
            f" {canary_s:.1f} s after the fault"
        )
    finally:
        time.sleep(5)  # the repair run's last states
        teardown(fault.recipe, cluster=cluster, nodes=fault.nodes)


def probe_cpu(cluster: str, reporter: Reporter) -> str:
    """The process's CPU while the sentinel watches one serving deployment and nothing else
    runs here: per deployment per hour."""
    from flows.deploy import deploy
    from flows.teardown import teardown

    plan = load_plan("lab-single", cluster, ["node1"])
    deploy("lab-single", cluster=cluster, nodes=["node1"])
    try:
        wait_for("watch", lambda: plan.deployment_id in reporter.watched, WATCHED_TIMEOUT_S)
        cpu = time.process_time()
        time.sleep(CPU_WINDOW_S)
        cpu = time.process_time() - cpu
    finally:
        teardown("lab-single", cluster=cluster, nodes=["node1"])
    return (
        f"probe cost: {cpu:.2f} CPU s over {CPU_WINDOW_S:.0f} s for one deployment:"
        f" {cpu / CPU_WINDOW_S * 3600:.0f} CPU s an hour per deployment on the ops host;"
        " the Prefect server: no request per probe, one event per transition"
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
            {**server.env(), "PREFECT_WORKER_QUERY_SECONDS": "1"}, workdir / "worker.log"
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
    parser.add_argument("--no-cpu", action="store_true", help="skip the probe's CPU window")
    options = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    lab = Lab(options.lab, 3)
    lab.up()
    try:
        build_engine_image(lab)
        publish_lab_models(lab.hub_repos_dir)
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
            lines = [] if options.no_cpu else [probe_cpu(cluster, reporter)]
            print(*lines, flush=True)
            chosen = options.faults.split(",")
            for fault in [fault for fault in FAULTS if fault.name in chosen]:
                lines.append(measure(lab, cluster, reporter, fault))
                print(lines[-1], flush=True)
        print("\n".join(["", "mttr:", *lines]))
    finally:
        lab.down()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
