"""The fault matrix (tests/fault_matrix.py) under a Prefect process worker: a deploy cancelled,
its process killed, its worker killed mid-boot; a redeploy cancelled during its prefetch."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fault_matrix import (
    FAULT_MATRIX_MARKS,
    STRIKE_POLL_S,
    STRIKE_WAIT_S,
    deploys,
    hub_faults,
    nothing_left,
    wall_time,
)
from lab_flows import (
    LAB_SINGLE_RECIPE,
    Matrix,
    Worker,
    ask,
    flow_process,
    recipe_variant,
    wait_for_state,
    with_env,
)

from flows.teardown import teardown
from lab.cluster import Lab
from lab.prefect_local import deployment_run, run_prefect
from lab.testing.waiting import wait_for
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import load_plan
from sparkdeploy.steps.hold_nodes import holders
from sparkdeploy.steps.status import cluster_status

if TYPE_CHECKING:
    from prefect.client.schemas.objects import Log

pytestmark = FAULT_MATRIX_MARKS

# What a Prefect process worker does before a hook of the deploy runs: it notices a
# cancellation at its next poll (seconds), sends SIGTERM and waits for the flow's process to
# end, then loads the flow from its deployment (a Python import of the project, seconds on two
# busy cores) to run the hook.
BOUND_WORKER_S = 60.0


def logged(flow_run_id: str, prefix: str, timeout_s: float = 60.0) -> tuple[str, float]:
    """The run's first log line starting with prefix (the hooks log after the run's end)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:

        def said() -> list[Log]:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            return [log for log in logs if log.message.startswith(prefix)]

        first = wait_for(f"log line {prefix!r}", said, timeout_s=timeout_s, poll_s=0.5)[0]
    return first.message, wall_time(first.timestamp)


def booting(lab: Lab, cluster: str, worker: Worker) -> None:
    """Once the run's containers exist (its boot has begun)."""
    inventory = load_cluster(Path(cluster))
    try:
        wait_for("boot", lambda: cluster_status(inventory), timeout_s=300, poll_s=STRIKE_POLL_S)
    except TimeoutError:
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
    assert state.name is not None, state
    assert state.name.lower() == hook, state
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
    recipe = recipe_variant(
        tmp_path, "lab-slow", LAB_SINGLE_RECIPE, with_env(STANDIN_FAULT="slow_boot:20")
    )

    def cancel(flow_run_id: str) -> None:
        run_prefect(worker.env, "flow-run", "cancel", flow_run_id)

    def kill_its_process(flow_run_id: str) -> None:
        """As the OOM killer or a person would: the worker then marks the run Crashed."""
        process = wait_for(
            "process running the flow run",
            lambda: flow_process(worker.running().pid, flow_run_id),
            timeout_s=STRIKE_WAIT_S,
            poll_s=STRIKE_POLL_S,
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
            "redeploy taking the holds over",
            lambda: all(
                holder is not None and holder.flow_run_id == second
                for holder in holders(plan.cluster, nodes).values()
            ),
            timeout_s=120,
            poll_s=STRIKE_POLL_S,
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
