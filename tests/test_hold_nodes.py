"""Node locks against a real Prefect server (prefect_test_harness)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from uuid import UUID

import httpx
import pytest
from prefect import flow, get_client
from prefect.client.base import PrefectHttpxSyncClient
from prefect.states import Completed, Running, State

from lab.cluster import Lab
from sparkdeploy.errors import NodeLockError
from sparkdeploy.remote.docker_cli import DEPLOYMENT_LABEL, deployments_present
from sparkdeploy.remote.ssh import cached_connection
from sparkdeploy.steps import hold_nodes as locks
from sparkdeploy.steps.hold_nodes import (
    NodeHolder,
    acquire_nodes,
    holder_decision,
    holder_variable,
    holders,
    release_nodes,
)


def test_second_deployment_waits_then_fails_naming_the_holder(prefect_harness: Path) -> None:
    assert acquire_nodes("lab", ["node1", "node2"], "dep-a", timeout_s=5) == ["node1", "node2"]
    with pytest.raises(NodeLockError) as caught:
        acquire_nodes("lab", ["node2", "node3"], "dep-b", timeout_s=1.5, poll_s=0.2)
    message = str(caught.value)
    assert "node2 is held by deployment dep-a" in message
    assert "node3 is held" not in message
    # All or nothing: dep-b's failed attempt left node3 free.
    assert holders("lab", ["node3"]) == {"node3": None}
    assert release_nodes("lab", ["node1", "node2"], "dep-a") == ["node1", "node2"]


def test_lock_calls_leave_the_runs_own_client_with_prefects_retries(prefect_harness: Path) -> None:
    @flow
    def holding_a_node() -> tuple[type, type]:
        with get_client(sync_client=True) as run_client:
            acquire_nodes("lab", ["node9"], "dep-run", timeout_s=5)
            release_nodes("lab", ["node9"], "dep-run")
            with locks._lock_client() as lock_client:
                return type(run_client._client), type(lock_client._client)

    run_http, lock_http = holding_a_node()
    assert run_http is PrefectHttpxSyncClient
    assert lock_http is locks._SingleAttemptHttpxClient


def test_acquire_is_idempotent_and_release_only_frees_own_nodes(prefect_harness: Path) -> None:
    assert acquire_nodes("lab", ["node4"], "dep-c", timeout_s=5) == ["node4"]
    assert acquire_nodes("lab", ["node4"], "dep-c", timeout_s=5) == []
    assert release_nodes("lab", ["node4"], "dep-other") == []
    holder = holders("lab", ["node4"])["node4"]
    assert holder is not None and holder.deployment_id == "dep-c"
    assert release_nodes("lab", ["node4"], "dep-c") == ["node4"]
    assert release_nodes("lab", ["node4"], "dep-c") == []
    assert acquire_nodes("lab", ["node4"], "dep-d", timeout_s=5) == ["node4"]
    release_nodes("lab", ["node4"], "dep-d")


def test_waiting_deployment_gets_the_node_once_released(prefect_harness: Path) -> None:
    acquire_nodes("lab", ["node5"], "dep-e", timeout_s=5)
    taken: list[list[str]] = []
    waiter = threading.Thread(
        target=lambda: taken.append(
            acquire_nodes("lab", ["node5"], "dep-f", timeout_s=30, poll_s=0.2)
        )
    )
    waiter.start()
    release_nodes("lab", ["node5"], "dep-e")
    waiter.join(timeout=40)
    assert taken == [["node5"]]
    holder = holders("lab", ["node5"])["node5"]
    assert holder is not None and holder.deployment_id == "dep-f"
    release_nodes("lab", ["node5"], "dep-f")


def test_concurrent_acquirers_never_share_a_node(prefect_harness: Path) -> None:
    outcomes: dict[str, object] = {}

    def attempt(deployment: str) -> None:
        try:
            outcomes[deployment] = acquire_nodes(
                "race", ["a", "b"], deployment, timeout_s=2, poll_s=0.2
            )
        except NodeLockError as error:
            outcomes[deployment] = error

    threads = [threading.Thread(target=attempt, args=(f"dep-{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    winners = [dep for dep, outcome in outcomes.items() if isinstance(outcome, list)]
    assert len(winners) == 1
    for node, holder in holders("race", ["a", "b"]).items():
        assert holder is not None and holder.deployment_id == winners[0], node
    release_nodes("race", ["a", "b"], winners[0])


def test_holder_variable_names_are_valid_and_distinct() -> None:
    names = {holder_variable("Lab", "Node1"), holder_variable("lab", "node1")}
    assert len(names) == 2
    assert all(name.replace("-", "").isalnum() and name == name.lower() for name in names)


def _flow_run(state: State[None]) -> str:
    from prefect import flow

    @flow(name="lock-holder")
    def holder_flow() -> None:
        return None

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(holder_flow, state=state)
    return str(run.id)


def test_a_live_run_of_the_same_deployment_is_waited_for_an_ended_one_taken_over(
    prefect_harness: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, third = _flow_run(Running()), _flow_run(Running()), _flow_run(Running())
    monkeypatch.setattr(locks, "_current_flow_run_id", lambda: first)
    assert acquire_nodes("same", ["n1"], "dep-same", timeout_s=5) == ["n1"]

    # A concurrent deploy of the same recipe on the same nodes: the same deployment id.
    monkeypatch.setattr(locks, "_current_flow_run_id", lambda: second)
    with pytest.raises(NodeLockError, match=f"n1 is held by deployment dep-same .*{first}"):
        acquire_nodes("same", ["n1"], "dep-same", timeout_s=1, poll_s=0.2)

    # Once the first run has ended (the deployment stays up), a redeploy takes the nodes over.
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(UUID(first), Completed(), force=True)
    monkeypatch.setattr(locks, "_current_flow_run_id", lambda: third)
    assert acquire_nodes("same", ["n1"], "dep-same", timeout_s=5) == []
    holder = holders("same", ["n1"])["n1"]
    assert holder is not None and holder.flow_run_id == third
    assert release_nodes("same", ["n1"], "dep-same") == ["n1"]


def test_limits_are_created_for_new_nodes_beside_existing_ones(prefect_harness: Path) -> None:
    assert acquire_nodes("grow", ["n1"], "dep-g", timeout_s=5) == ["n1"]
    release_nodes("grow", ["n1"], "dep-g")
    # n1's limit exists, n2's not yet: both are taken, and n1 only once.
    assert acquire_nodes("grow", ["n1", "n2"], "dep-h", timeout_s=5) == ["n1", "n2"]
    with get_client(sync_client=True) as client:
        for node in ("n1", "n2"):
            limit = client.read_global_concurrency_limit_by_name(f"node:grow:{node}")
            assert (limit.limit, limit.active_slots) == (1, 1), node
    assert release_nodes("grow", ["n1", "n2"], "dep-h") == ["n1", "n2"]
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name("node:grow:n2").active_slots == 0


def _status_error(status: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://prefect.invalid/api/v2/concurrency_limits/increment")
    return httpx.HTTPStatusError(
        f"HTTP {status}", request=request, response=httpx.Response(status, request=request)
    )


def test_busy_answers_are_retried_at_once_and_other_errors_are_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers: list[int | str] = [503, 429, 503, "taken"]

    def call(name: str) -> str:
        answer = answers.pop(0)
        if isinstance(answer, int):
            raise _status_error(answer)
        return f"{answer} {name}"

    waits: list[float] = []
    monkeypatch.setattr(locks.time, "sleep", waits.append)
    assert locks._api(call, "node1") == "taken node1"
    assert len(waits) == 3 and sum(waits) < 1.0  # not the Prefect client's ~2 s per retry

    answers[:] = [423]
    with pytest.raises(httpx.HTTPStatusError):
        locks._api(call, "node1")
    assert len(waits) == 3


def test_a_busy_answer_costs_the_lock_client_no_2_s_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = [httpx.Response(503, headers={"Retry-After": "2"}), httpx.Response(200, json=[])]
    sent: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        return answers.pop(0)

    # Every wait, Prefect's client's included (it sleeps Retry-After even on its last attempt).
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    http = locks._SingleAttemptHttpxClient(
        transport=httpx.MockTransport(answer), base_url="http://prefect.invalid/api"
    )
    assert locks._api(http.post, "/variables/filter").json() == []
    assert sent == ["/api/variables/filter"] * 2
    assert len(waits) == 1 and waits[0] < 0.1


def test_only_a_provably_gone_holder_is_taken_over() -> None:
    other = NodeHolder("n1", "dep-old", "2025-01-01T00:00:00+00:00", "run-old")
    same = NodeHolder("n1", "dep-new", "2025-01-01T00:00:00+00:00", "run-old")
    mine = NodeHolder("n1", "dep-new", "2025-01-01T00:00:00+00:00", "run-new")

    def decide(holder: NodeHolder, ended: bool, left: bool | None) -> str:
        return holder_decision(holder, "dep-new", "run-new", run_ended=ended, containers_left=left)

    assert decide(mine, False, None) == "ours"
    # Another deployment: both its run ended and its containers gone, else waited for.
    assert decide(other, True, False) == "take over"
    assert decide(other, True, True) == "wait"
    assert decide(other, True, None) == "wait"  # the node could not be asked
    assert decide(other, False, False) == "wait"  # a live run may be about to start them
    # The same deployment (a redeploy): its containers are this deployment's, boot replaces them.
    assert decide(same, True, True) == "take over"
    assert decide(same, False, False) == "wait"


def _containers_on(lab: Lab) -> locks.ContainerCheck:
    targets = lab.ssh_targets()
    return lambda deployment_of: deployments_present(targets, deployment_of)


def _hold_with_ended_run(monkeypatch: pytest.MonkeyPatch, cluster: str, node: str, dep: str) -> str:
    run = _flow_run(Running())
    monkeypatch.setattr(locks, "_current_flow_run_id", lambda: run)
    assert acquire_nodes(cluster, [node], dep, timeout_s=5) == [node]
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(UUID(run), Completed(), force=True)
    monkeypatch.setattr(locks, "_current_flow_run_id", lambda: _flow_run(Running()))
    return run


@pytest.mark.lab
def test_a_finished_holder_without_containers_is_taken_over_at_once(
    prefect_harness: Path, lab_cluster: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = lab_cluster.nodes[0]
    old_run = _hold_with_ended_run(monkeypatch, "lab-takeover", node, "lab-gone-0badc0de")
    warnings: list[str] = []
    started = time.monotonic()
    taken = acquire_nodes(
        "lab-takeover",
        [node],
        "lab-new-12345678",
        timeout_s=60,
        containers_on=_containers_on(lab_cluster),
        warn=warnings.append,
    )
    assert taken == [node]
    assert time.monotonic() - started < 10  # not the wait
    assert len(warnings) == 1
    assert "lab-gone-0badc0de" in warnings[0] and old_run in warnings[0], warnings
    holder = holders("lab-takeover", [node])[node]
    assert holder is not None and holder.deployment_id == "lab-new-12345678"
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(f"node:lab-takeover:{node}")
        assert limit.active_slots == 1  # the slot passed over, not taken twice
    assert release_nodes("lab-takeover", [node], "lab-new-12345678") == [node]


@pytest.mark.lab
def test_a_finished_holder_whose_containers_remain_is_waited_for(
    prefect_harness: Path, lab_cluster: Lab, lab_engine_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = lab_cluster.nodes[1]
    _hold_with_ended_run(monkeypatch, "lab-takeover", node, "lab-left-0badc0de")
    runner = cached_connection(lab_cluster.ssh_target(node))
    name = "lock-test-leftover"
    runner.run(
        [
            *("docker", "create", "--name", name),
            *("--label", f"{DEPLOYMENT_LABEL}=lab-left-0badc0de", lab_engine_image, "sleep", "600"),
        ],
        timeout=300,
    )
    try:
        with pytest.raises(NodeLockError, match="its containers are still on"):
            acquire_nodes(
                "lab-takeover",
                [node],
                "lab-new-12345678",
                timeout_s=2,
                poll_s=0.5,
                containers_on=_containers_on(lab_cluster),
            )
    finally:
        runner.run(["docker", "rm", "--force", name], timeout=60)
    holder = holders("lab-takeover", [node])[node]
    assert holder is not None and holder.deployment_id == "lab-left-0badc0de"
    # Once the leftover is gone, the same deploy takes the node over.
    assert acquire_nodes(
        "lab-takeover",
        [node],
        "lab-new-12345678",
        timeout_s=10,
        containers_on=_containers_on(lab_cluster),
    ) == [node]
    release_nodes("lab-takeover", [node], "lab-new-12345678")
