"""The pipeline as a team runs it (lab.team): PostgreSQL, Redis, two API servers behind nginx,
the services apart, process workers on two ops hosts; an 8-node lab.

Four 2-node deploys started at once all complete, each on its own nodes, picked up by both
workers, while the watchdog and prefetch schedules fire and never hold a node; two deploys
racing for a shared node: one runs, the other waits and runs after the first's teardown; a
deployment with a concurrency limit queues its second run; an API server killed in the middle
of a deploy: the deploy completes through the other."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING
from uuid import UUID

import pytest
from lab_flows import (
    answers_the_canary,
    final_run_logs,
    lab_brought_up,
    nothing_runs,
    task_history,
)

from lab.image import build_engine_image
from lab.models import publish_lab_models
from lab.prefect_local import deployment_run, register_deployments, register_flow, run_prefect
from lab.team import TeamControlPlane
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import load_plan
from sparkdeploy.steps.hold_nodes import holders
from sparkdeploy.steps.status import cluster_status

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

pytestmark = [pytest.mark.lab]

TEAM_LAB = os.environ.get("SPARKDEPLOY_TEST_LAB", "pytest")[:15] + "-team"
RECIPE = "lab-pair"
DEPLOY_TIMEOUT_S = 900.0
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
# The watchdog's and the nightly prefetch's schedules, made frequent for the test.
SCHEDULE_INTERVAL_S = 15


@pytest.fixture(scope="module")
def team() -> Iterator[TeamControlPlane]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with lab_brought_up(TEAM_LAB, 8, ops_hosts=2) as lab:
        plane = TeamControlPlane(lab, lab.layout.state_dir / "prefect-team")
        try:
            build_engine_image(lab)
            publish_lab_models(lab.hub_repos_dir)
            plane.start()
            register_deployments(plane.env())
            for ops_host in lab.ops_hosts:
                # Three runs each at most: four deploys and the two schedules' runs at once are
                # shared between the hosts.
                plane.start_worker(ops_host, limit=3)
            with temporary_settings({PREFECT_API_URL: plane.api_url}):
                yield plane
        finally:
            plane.stop()


@pytest.fixture(autouse=True)
def leaves_the_lab_clean(team: TeamControlPlane) -> Iterator[None]:
    """Whatever a test left (a failed one stops half-way): its runs cancelled, its deployments
    torn down, so that the next test starts on free nodes instead of failing after it."""
    yield
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled, Cancelling

    going = FlowRunFilter(
        state=FlowRunFilterState(
            type=FlowRunFilterStateType(
                any_=[StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED]
            )
        )
    )
    now = datetime.now(UTC)
    with get_client(sync_client=True) as client:
        unfinished = [
            run
            for run in client.read_flow_runs(flow_run_filter=going)
            # The lab's own schedules' future runs stay.
            if run.state_type != StateType.SCHEDULED
            or (run.expected_start_time is not None and run.expected_start_time <= now)
        ]
        for run in unfinished:
            # A run no worker took is cancelled at once; one that runs, by its worker.
            waiting = run.state_type in {StateType.SCHEDULED, StateType.PAUSED}
            client.set_flow_run_state(run.id, Cancelled() if waiting else Cancelling(), force=True)
    # Bounded, without failing: a run the server refused to end (its process gone) can stay
    # Cancelling for minutes, and holds no node.
    deadline = time.monotonic() + 120
    ids = [str(run.id) for run in unfinished]
    while ids and time.monotonic() < deadline and not all_final(states(ids)):
        time.sleep(2)
    left = cluster_status(load_cluster(Path(inventory(team))))
    if left:
        tear_down(team, [deployment.nodes for deployment in left])


def inventory(team: TeamControlPlane) -> str:
    return str(team.lab.inventory_path)


def deploy_params(team: TeamControlPlane, nodes: Sequence[str]) -> dict[str, object]:
    return {"recipe": RECIPE, "cluster": inventory(team), "nodes": list(nodes)}


def start_at_once(
    team: TeamControlPlane, deployment: str, runs: Sequence[Mapping[str, object]]
) -> list[str]:
    """`prefect deployment run` of each parameter set, all started at the same moment."""
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        return list(pool.map(lambda params: deployment_run(team.env(), deployment, params), runs))


def states(run_ids: Sequence[str]) -> dict[str, str]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {run_id: state_of(client.read_flow_run(UUID(run_id))) for run_id in run_ids}


def state_of(run: FlowRun) -> str:
    """`TYPE/Name`, e.g. `SCHEDULED/AwaitingConcurrencySlot`."""
    return (run.state_type.value if run.state_type else "?") + f"/{run.state_name}"


def ended_without_completing(found: Mapping[str, str]) -> bool:
    return bool({state.split("/")[0] for state in found.values()} & (FINAL - {"COMPLETED"}))


def all_final(found: Mapping[str, str]) -> bool:
    return all(state.split("/")[0] in FINAL for state in found.values())


def wait_until_final(run_ids: Sequence[str], timeout_s: float = DEPLOY_TIMEOUT_S) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = states(run_ids)
        if all_final(found):
            return found
        assert time.monotonic() < deadline, f"runs not done after {timeout_s:.0f} s: {found}"
        time.sleep(2)


def run_logs(run_id: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(run_id)]))
        )
    return "\n".join(log.message for log in logs)


def logs_once_they_say(run_id: str, text: str, timeout_s: float = 60.0) -> str:
    """The run's logs once they contain `text` (a flow run's logs reach the server in batches,
    seconds after they are written)."""
    deadline = time.monotonic() + timeout_s
    while text not in (logs := run_logs(run_id)):
        assert time.monotonic() < deadline, f"flow run {run_id} never logged {text!r}:\n{logs}"
        time.sleep(1)
    return logs


def flow_runs(run_ids: Sequence[str]) -> list[FlowRun]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return [client.read_flow_run(UUID(run_id)) for run_id in run_ids]


def runs_of(deployment: str, *, completed_only: bool = False) -> list[FlowRun]:
    """The runs of a deployment (`flow/name`) so far, or its completed ones."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    completed = FlowRunFilter(
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.COMPLETED]))
    )
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(
            deployment_filter=DeploymentFilter(
                name=DeploymentFilterName(any_=[deployment.partition("/")[2]])
            ),
            flow_run_filter=completed if completed_only else None,
        )


def ran_between(deployment: str, started: datetime, ended: datetime) -> list[FlowRun]:
    """The deployment's runs that were going at some moment between `started` and `ended`."""
    return [
        run
        for run in runs_of(deployment)
        if run.start_time is not None
        and run.start_time <= ended
        and (run.end_time is None or run.end_time >= started)
    ]


def explained(found: Mapping[str, str]) -> str:
    """The states, and the end of the log of each run that did not complete: what a failure in
    CI needs to be understood."""
    return "\n".join(
        [f"{found}"]
        + [
            f"--- {run} ({state}):\n" + "\n".join(run_logs(run).splitlines()[-40:])
            for run, state in found.items()
            if state != "COMPLETED/Completed"
        ]
    )


def all_completed(run_ids: Sequence[str]) -> None:
    found = wait_until_final(run_ids)
    assert found == dict.fromkeys(run_ids, "COMPLETED/Completed"), explained(found)


def tear_down(team: TeamControlPlane, node_sets: Sequence[Sequence[str]]) -> None:
    all_completed(
        start_at_once(team, "teardown/teardown", [deploy_params(team, n) for n in node_sets])
    )


def test_four_deploys_at_once_each_on_its_own_nodes_while_schedules_fire(
    team: TeamControlPlane,
) -> None:
    node_sets = [["node1", "node2"], ["node3", "node4"], ["node5", "node6"], ["node7", "node8"]]
    scheduled = [
        register_flow(
            team.env(),
            "flows/smoke.py:smoke",
            "team-watchdog",
            {"cluster": inventory(team)},
            interval_s=SCHEDULE_INTERVAL_S,
            description="the watchdog, often, while the team deploys",
        ),
        register_flow(
            team.env(),
            "flows/prefetch_all.py:prefetch_all",
            "team-prefetch",
            {"cluster": inventory(team), "recipes": "lab-*"},
            interval_s=SCHEDULE_INTERVAL_S,
            description="the nightly prefetch, often, while the team deploys",
        ),
    ]
    try:
        # The schedules fire on their own before the deploys start, and go on while they run.
        deadline = time.monotonic() + 180
        while not all(runs_of(schedule, completed_only=True) for schedule in scheduled):
            assert time.monotonic() < deadline, "the schedules did not fire within 180 s"
            time.sleep(2)
        started = datetime.now(UTC)
        runs = start_at_once(team, "deploy/deploy", [deploy_params(team, n) for n in node_sets])
        all_completed(runs)
        ended = datetime.now(UTC)

        cluster = load_cluster(Path(inventory(team)))
        running = {tuple(deployment.nodes): deployment for deployment in cluster_status(cluster)}
        assert sorted(running) == [tuple(nodes) for nodes in node_sets]
        for nodes in node_sets:
            deployment = running[tuple(nodes)]
            assert deployment.healthy, deployment
            held = holders(cluster.name, nodes).values()
            assert {h.deployment_id if h else None for h in held} == {deployment.deployment_id}
            assert answers_the_canary(load_plan(RECIPE, inventory(team), nodes).endpoint)
        # Whichever worker was free took each run: both ops hosts took some.
        taken_by = {run: team.ran_on(run) for run in runs}
        assert set(taken_by.values()) == set(team.lab.ops_hosts), taken_by

        for schedule in scheduled:
            # A run that went on while the deploys ran, whenever it started (under load a
            # schedule's runs queue behind the deploys for a worker slot, and a prefetch waits for
            # the NAS lock a deploy's prefetch holds), completes; and no run holds a node.
            deadline = time.monotonic() + 300
            while True:
                overlapping = ran_between(schedule, started, ended)
                found = {str(run.id): state_of(run) for run in overlapping}
                if "COMPLETED/Completed" in found.values():
                    break
                assert time.monotonic() < deadline, (
                    f"no run of {schedule} went on and completed while the deploys ran: "
                    + explained(found)
                )
                time.sleep(2)
            for run in runs_of(schedule, completed_only=True):
                history = task_history(str(run.id), settled=True)
                assert not [task for task in history if "hold-nodes" in task], (schedule, history)
    finally:
        # Not left firing into the next tests, whatever this one found.
        for schedule in scheduled:
            run_prefect(team.env(), "deployment", "delete", schedule)
    tear_down(team, node_sets)
    nothing_runs(inventory(team))


def test_two_deploys_racing_for_a_node_run_one_after_the_other(team: TeamControlPlane) -> None:
    first_nodes, second_nodes = ["node1", "node2"], ["node2", "node3"]
    runs = start_at_once(
        team, "deploy/deploy", [deploy_params(team, first_nodes), deploy_params(team, second_nodes)]
    )
    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    while "COMPLETED/Completed" not in (found := states(runs)).values():
        assert time.monotonic() < deadline, explained(found)
        assert not ended_without_completing(found), explained(found)
        time.sleep(2)
    [winner] = [run for run, state in found.items() if state == "COMPLETED/Completed"]
    [waiter] = [run for run in runs if run != winner]
    winner_nodes, waiter_nodes = (
        (first_nodes, second_nodes) if winner == runs[0] else (second_nodes, first_nodes)
    )
    winner_id = load_plan(RECIPE, inventory(team), winner_nodes).deployment_id
    # The waiter may start only as the winner ends (its worker and process come up on shared
    # cores; CI once found it still Submitting then): it runs soon after, without ending, and
    # what it waits for shows in its logs.
    running_by = time.monotonic() + 60
    while (waiting := states([waiter]))[waiter] != "RUNNING/Running":
        assert waiting[waiter].split("/")[0] not in FINAL, explained(waiting)
        assert time.monotonic() < running_by, explained(waiting)
        time.sleep(1)
    assert winner_id in logs_once_they_say(waiter, f"waiting for nodes of cluster {TEAM_LAB}")

    tear_down(team, [winner_nodes])
    all_completed([waiter])
    [running] = cluster_status(load_cluster(Path(inventory(team))))
    assert running.nodes == waiter_nodes
    assert running.healthy
    tear_down(team, [waiter_nodes])
    nothing_runs(inventory(team))


def test_a_deployment_concurrency_limit_queues_the_second_run(team: TeamControlPlane) -> None:
    one_at_a_time = register_flow(
        team.env(),
        "flows/deploy.py:deploy",
        "one-at-a-time",
        {},
        collision_strategy="ENQUEUE",
        description="deploys one after another (deployment concurrency limit 1, ENQUEUE)",
    )
    node_sets = [["node4", "node5"], ["node6", "node7"]]
    runs = start_at_once(team, one_at_a_time, [deploy_params(team, n) for n in node_sets])
    seen: dict[str, set[str]] = {run: set() for run in runs}
    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    while not all_final(found := states(runs)):
        assert time.monotonic() < deadline, explained(found)
        # A run that failed frees the slot: the other must not wait out the whole deadline.
        assert not ended_without_completing(found), explained(found)
        assert list(found.values()).count("RUNNING/Running") <= 1, found
        for run, state in found.items():
            seen[run].add(state)
        time.sleep(0.5)
    assert found == dict.fromkeys(runs, "COMPLETED/Completed"), explained(found)
    # Prefect's documented behaviour: the later run waits for the slot instead of starting.
    assert any("SCHEDULED/AwaitingConcurrencySlot" in states_seen for states_seen in seen.values())
    first, second = sorted(
        flow_runs(runs),
        key=lambda run: run.start_time.timestamp() if run.start_time else float("inf"),
    )
    assert first.end_time is not None
    assert second.start_time is not None
    assert first.end_time <= second.start_time
    tear_down(team, node_sets)
    nothing_runs(inventory(team))


def test_a_deploy_whose_worker_died_is_crashed_and_its_nodes_taken_over(
    team: TeamControlPlane,
) -> None:
    nodes = ["node7", "node8"]
    run = deployment_run(team.env(), "deploy/deploy", deploy_params(team, nodes))
    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    while not [t for t in task_history(run) if t.startswith("hold-nodes") and "Completed" in t]:
        assert time.monotonic() < deadline, task_history(run)
        time.sleep(0.5)
    ops_host = team.ran_on(run)
    assert ops_host is not None, explained(states([run]))
    team.lab.lose_ops_host(ops_host)
    deadline = time.monotonic() + 300
    while states([run])[run] != "CRASHED/Crashed":
        assert time.monotonic() < deadline, f"not marked Crashed: {states([run])}"
        time.sleep(2)
    team.start_worker(ops_host, limit=3)

    again = deployment_run(
        team.env(), "deploy/deploy", deploy_params(team, nodes), watch_timeout_s=DEPLOY_TIMEOUT_S
    )
    deployment_id = load_plan(RECIPE, inventory(team), nodes).deployment_id
    logs = "\n".join(final_run_logs(again))
    assert f"deployment {deployment_id} goes on holding it" in logs, logs
    [running] = cluster_status(load_cluster(Path(inventory(team))))
    assert running.nodes == nodes
    assert running.healthy
    tear_down(team, [nodes])
    nothing_runs(inventory(team))


def test_an_api_server_killed_mid_deploy_leaves_the_deploy_to_the_other(
    team: TeamControlPlane,
) -> None:
    nodes = ["node5", "node6"]
    run = deployment_run(team.env(), "deploy/deploy", deploy_params(team, nodes))
    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    while not [t for t in task_history(run) if t.startswith("hold-nodes") and "Completed" in t]:
        assert time.monotonic() < deadline, task_history(run)
        time.sleep(0.5)
    team.kill_api_server(1)
    all_completed([run])
    history = task_history(run, settled=True)
    assert [t for t in history if t.startswith("smoke-test ") and t.endswith(": Completed")]
    [running] = cluster_status(load_cluster(Path(inventory(team))))
    assert running.nodes == nodes
    assert running.healthy
    tear_down(team, [nodes])
    nothing_runs(inventory(team))
