"""Node locks against a real Prefect server (prefect_test_harness)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from pathlib import Path
from uuid import UUID

import httpx
import pytest
from prefect import State, flow, get_client
from prefect.client.base import PrefectHttpxSyncClient
from prefect.client.schemas.actions import VariableCreate
from prefect.states import Completed, Running

from lab.cluster import Lab
from lab.testing.waiting import wait_for
from sparkdeploy.errors import NodeLockError, RemoteError
from sparkdeploy.remote.docker_cli import deployments_present
from sparkdeploy.remote.node_identity import machine_ids, parse_machine_id
from sparkdeploy.remote.prefect_api import SingleAttemptHttpxClient, single_attempt_client
from sparkdeploy.remote.ssh import cached_connection
from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.labels import DEPLOYMENT_LABEL
from sparkdeploy.spec.plan import make_plan
from sparkdeploy.spec.project import find_recipe
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.steps import hold_nodes as locks
from sparkdeploy.steps.hold_nodes import (
    NodeHolder,
    acquire,
    acquire_nodes,
    api,
    holder_decision,
    holder_variable,
    holders,
    limit_name,
    records,
    release,
    release_nodes,
    slots,
)
from sparkdeploy.steps.hold_nodes import queue as wait_queue


def machines(cluster: str, *nodes: str) -> dict[str, str]:
    """Made-up machine ids for nodes of a made-up cluster: each name its own machine."""
    return {node: hashlib.sha256(f"{cluster}/{node}".encode()).hexdigest()[:32] for node in nodes}


def test_second_deployment_waits_then_fails_naming_the_holder(prefect_harness: Path) -> None:
    assert acquire_nodes("lab", machines("lab", "node1", "node2"), "dep-a", timeout_s=5) == [
        "node1",
        "node2",
    ]
    with pytest.raises(NodeLockError) as caught:
        acquire_nodes("lab", machines("lab", "node2", "node3"), "dep-b", timeout_s=1.5, poll_s=0.2)
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
            acquire_nodes("lab", machines("lab", "node9"), "dep-run", timeout_s=5)
            release_nodes("lab", ["node9"], "dep-run")
            with single_attempt_client() as lock_client:
                return type(run_client._client), type(lock_client._client)

    run_http, lock_http = holding_a_node()
    assert run_http is PrefectHttpxSyncClient
    assert lock_http is SingleAttemptHttpxClient


def test_acquire_is_idempotent_and_release_only_frees_own_nodes(prefect_harness: Path) -> None:
    assert acquire_nodes("lab", machines("lab", "node4"), "dep-c", timeout_s=5) == ["node4"]
    assert acquire_nodes("lab", machines("lab", "node4"), "dep-c", timeout_s=5) == []
    assert release_nodes("lab", ["node4"], "dep-other") == []
    holder = holders("lab", ["node4"])["node4"]
    assert holder is not None
    assert holder.deployment_id == "dep-c"
    assert release_nodes("lab", ["node4"], "dep-c") == ["node4"]
    assert release_nodes("lab", ["node4"], "dep-c") == []
    assert acquire_nodes("lab", machines("lab", "node4"), "dep-d", timeout_s=5) == ["node4"]
    release_nodes("lab", ["node4"], "dep-d")


def test_waiting_deployment_gets_the_node_once_released(prefect_harness: Path) -> None:
    acquire_nodes("lab", machines("lab", "node5"), "dep-e", timeout_s=5)
    taken: list[list[str]] = []
    waiter = threading.Thread(
        target=lambda: taken.append(
            acquire_nodes("lab", machines("lab", "node5"), "dep-f", timeout_s=30, poll_s=0.2)
        )
    )
    waiter.start()
    release_nodes("lab", ["node5"], "dep-e")
    waiter.join(timeout=40)
    assert taken == [["node5"]]
    holder = holders("lab", ["node5"])["node5"]
    assert holder is not None
    assert holder.deployment_id == "dep-f"
    release_nodes("lab", ["node5"], "dep-f")


def wait_tickets() -> list[wait_queue.WaitTicket]:
    with single_attempt_client() as client:
        return wait_queue._wait_tickets(client)


def test_waiting_deploys_get_a_node_in_arrival_order(prefect_harness: Path) -> None:
    node = machines("fifo", "n1")
    acquire_nodes("fifo", node, "dep-first", timeout_s=5)
    taken: list[str] = []

    def waiter(deployment: str) -> None:
        acquire_nodes("fifo", node, deployment, timeout_s=60, poll_s=0.1)
        taken.append(deployment)

    second = threading.Thread(target=waiter, args=("dep-second",))
    second.start()
    wait_for("wait ticket", lambda: len(wait_tickets()) == 1, timeout_s=30, poll_s=0.1)
    third = threading.Thread(target=waiter, args=("dep-third",))
    third.start()
    wait_for("second wait ticket", lambda: len(wait_tickets()) == 2, timeout_s=30, poll_s=0.1)
    release_nodes("fifo", ["n1"], "dep-first")
    wait_for("hold of dep-second", lambda: taken == ["dep-second"], timeout_s=30, poll_s=0.1)
    # The third waits for the second, who came first, and then for its hold.
    time.sleep(0.5)
    assert taken == ["dep-second"]
    [ticket] = wait_tickets()
    assert ticket.deployment_id == "dep-third"
    release_nodes("fifo", ["n1"], "dep-second")
    second.join(timeout=30)
    third.join(timeout=30)
    assert taken == ["dep-second", "dep-third"]
    assert wait_tickets() == []
    release_nodes("fifo", ["n1"], "dep-third")


def test_a_newcomer_does_not_overtake_a_waiter_and_says_whom_it_waits_for(
    prefect_harness: Path,
) -> None:
    both = machines("fifo2", "n1", "n2")
    acquire_nodes("fifo2", {"n1": both["n1"]}, "dep-holds-n1", timeout_s=5)
    waiter = threading.Thread(
        target=acquire_nodes, args=("fifo2", both, "dep-wants-both"), kwargs={"poll_s": 0.1}
    )
    waiter.start()
    wait_for("wait ticket", lambda: len(wait_tickets()) == 1, timeout_s=30, poll_s=0.1)
    # n2 is free, but the deploy waiting for n1 and n2 asked first.
    with pytest.raises(NodeLockError) as refused:
        acquire_nodes("fifo2", {"n2": both["n2"]}, "dep-wants-n2", timeout_s=1, poll_s=0.1)
    assert "deployment dep-wants-both" in str(refused.value)
    assert "goes first" in str(refused.value)
    assert [ticket.deployment_id for ticket in wait_tickets()] == ["dep-wants-both"]
    release_nodes("fifo2", ["n1"], "dep-holds-n1")
    waiter.join(timeout=30)
    assert {h.deployment_id for h in holders("fifo2", ["n1", "n2"]).values() if h} == {
        "dep-wants-both"
    }
    release_nodes("fifo2", ["n1", "n2"], "dep-wants-both")


def test_a_ticket_its_waiter_stopped_refreshing_is_passed_over(
    prefect_harness: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wait_queue, "TICKET_STALE_S", 1.0)
    node = machines("fifo3", "n1")
    with get_client(sync_client=True) as client:
        client.create_variable(
            VariableCreate(
                name="node-wait-left-by-a-dead-waiter",
                value={"deployment_id": "dep-dead", "machines": list(node.values())},
                tags=wait_queue.WAIT_TAGS,
            )
        )
    time.sleep(1.5)
    assert acquire_nodes("fifo3", node, "dep-alive", timeout_s=20, poll_s=0.2) == ["n1"]
    release_nodes("fifo3", ["n1"], "dep-alive")
    with get_client(sync_client=True) as client:
        client.delete_variable_by_name("node-wait-left-by-a-dead-waiter")


def test_concurrent_acquirers_never_share_a_node(prefect_harness: Path) -> None:
    outcomes: dict[str, object] = {}

    def attempt(deployment: str) -> None:
        try:
            outcomes[deployment] = acquire_nodes(
                "race", machines("race", "a", "b"), deployment, timeout_s=2, poll_s=0.2
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
        assert holder is not None, node
        assert holder.deployment_id == winners[0], node
    release_nodes("race", ["a", "b"], winners[0])


def test_lock_names_are_the_machines_and_readable() -> None:
    machine = "3d1219c7c4c5404aaa1f6d2a48adfda4"
    assert limit_name(machine) == "node:3d1219c7c4c5"
    assert holder_variable(machine) == "node-lock-3d1219c7c4c5"
    assert holder_variable(machine) != holder_variable("3d1219c7c4c6" + "0" * 20)


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
    monkeypatch.setattr(acquire, "_current_flow_run_id", lambda: first)
    assert acquire_nodes("same", machines("same", "n1"), "dep-same", timeout_s=5) == ["n1"]

    # A concurrent deploy of the same recipe on the same nodes: the same deployment id.
    monkeypatch.setattr(acquire, "_current_flow_run_id", lambda: second)
    with pytest.raises(NodeLockError, match=f"n1 is held by deployment dep-same .*{first}"):
        acquire_nodes("same", machines("same", "n1"), "dep-same", timeout_s=1, poll_s=0.2)

    # Once the first run has ended (the deployment stays up), a redeploy takes the nodes over.
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(UUID(first), Completed(), force=True)
    monkeypatch.setattr(acquire, "_current_flow_run_id", lambda: third)
    assert acquire_nodes("same", machines("same", "n1"), "dep-same", timeout_s=5) == []
    holder = holders("same", ["n1"])["n1"]
    assert holder is not None
    assert holder.flow_run_id == third
    assert release_nodes("same", ["n1"], "dep-same") == ["n1"]


def test_a_redeploy_that_ends_while_the_old_copy_serves_hands_the_hold_back_to_its_run(
    prefect_harness: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redeploy's takeover records the run it took over from; handed back where the old copy
    still serves, the record names that run again (since unchanged), and the slot stays taken.
    A node where nothing of the deployment is left is not handed back."""
    first, second = _flow_run(Running()), _flow_run(Running())
    nodes = machines("redo", "n1", "n2")
    monkeypatch.setattr(acquire, "_current_flow_run_id", lambda: first)
    assert acquire_nodes("redo", nodes, "dep-redo", timeout_s=5) == ["n1", "n2"]
    before = holders("redo", ["n1", "n2"])
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(UUID(first), Completed(), force=True)
    monkeypatch.setattr(acquire, "_current_flow_run_id", lambda: second)
    monkeypatch.setattr(release, "_current_flow_run_id", lambda: second)
    assert acquire_nodes("redo", nodes, "dep-redo", timeout_s=5) == []
    taken = holders("redo", ["n1", "n2"])
    assert all(h is not None and h.took_over_from == first for h in taken.values()), taken
    assert all(h is not None and h.flow_run_id == second for h in taken.values()), taken

    said: list[str] = []
    assert locks.hand_back_to_serving("redo", ["n1"], "dep-redo", log=said.append) == ["n1"]
    after = holders("redo", ["n1", "n2"])
    took, was = taken["n1"], before["n1"]
    assert took is not None
    assert was is not None
    assert after["n1"] == dataclasses.replace(took, flow_run_id=first, took_over_from=None)
    assert after["n1"].since == was.since
    assert after["n2"] == taken["n2"]
    assert "dep-redo still serves there" in said[0], said
    assert first in said[0], said
    # Idempotent: the record no longer says this run took it over.
    assert locks.hand_back_to_serving("redo", ["n1"], "dep-redo") == []
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(limit_name(nodes["n1"]))
        assert limit.active_slots == 1
    assert release_nodes("redo", ["n1", "n2"], "dep-redo") == ["n1", "n2"]


def test_limits_are_created_for_new_nodes_beside_existing_ones(prefect_harness: Path) -> None:
    grown = machines("grow", "n1", "n2")
    assert acquire_nodes("grow", machines("grow", "n1"), "dep-g", timeout_s=5) == ["n1"]
    release_nodes("grow", ["n1"], "dep-g")
    # n1's limit exists, n2's not yet: both are taken, and n1 only once.
    assert acquire_nodes("grow", grown, "dep-h", timeout_s=5) == ["n1", "n2"]
    with get_client(sync_client=True) as client:
        for node, machine in grown.items():
            limit = client.read_global_concurrency_limit_by_name(limit_name(machine))
            assert (limit.limit, limit.active_slots) == (1, 1), node
    assert release_nodes("grow", ["n1", "n2"], "dep-h") == ["n1", "n2"]
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(limit_name(grown["n2"]))
        assert limit.active_slots == 0


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
    monkeypatch.setattr(time, "sleep", waits.append)
    assert api._api(call, "node1") == "taken node1"
    assert len(waits) == 3
    assert sum(waits) < 1.0

    answers[:] = [423]
    with pytest.raises(httpx.HTTPStatusError):
        api._api(call, "node1")
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
    http = SingleAttemptHttpxClient(
        transport=httpx.MockTransport(answer), base_url="http://prefect.invalid/api"
    )
    assert api._api(http.post, "/variables/filter").json() == []
    assert sent == ["/api/variables/filter"] * 2
    assert len(waits) == 1
    assert waits[0] < 0.1


def test_only_a_provably_gone_holder_is_taken_over() -> None:
    since, machine = "2025-01-01T00:00:00+00:00", "0" * 32
    other = NodeHolder("n1", "dep-old", since, "run-old", "c", machine)
    same = NodeHolder("n1", "dep-new", since, "run-old", "c", machine)
    mine = NodeHolder("n1", "dep-new", since, "run-new", "c", machine)

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


def _lab_machines(lab: Lab, *nodes: str) -> dict[str, str]:
    return machine_ids({node: lab.ssh_target(node) for node in nodes})


def _hold_with_ended_run(
    monkeypatch: pytest.MonkeyPatch, lab: Lab, cluster: str, node: str, dep: str
) -> str:
    run = _flow_run(Running())
    monkeypatch.setattr(acquire, "_current_flow_run_id", lambda: run)
    assert acquire_nodes(cluster, _lab_machines(lab, node), dep, timeout_s=5) == [node]
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(UUID(run), Completed(), force=True)
    monkeypatch.setattr(acquire, "_current_flow_run_id", lambda: _flow_run(Running()))
    return run


@pytest.mark.lab
def test_a_finished_holder_without_containers_is_taken_over_at_once(
    prefect_harness: Path, lab_cluster: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = lab_cluster.nodes[0]
    old_run = _hold_with_ended_run(
        monkeypatch, lab_cluster, "lab-takeover", node, "lab-gone-0badc0de"
    )
    warnings: list[str] = []
    started = time.monotonic()
    taken = acquire_nodes(
        "lab-takeover",
        _lab_machines(lab_cluster, node),
        "lab-new-12345678",
        timeout_s=60,
        containers_on=_containers_on(lab_cluster),
        warn=warnings.append,
    )
    assert taken == [node]
    assert time.monotonic() - started < 10  # not the wait
    assert len(warnings) == 1
    assert "lab-gone-0badc0de" in warnings[0], warnings
    assert old_run in warnings[0], warnings
    holder = holders("lab-takeover", [node])[node]
    assert holder is not None
    assert holder.deployment_id == "lab-new-12345678"
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(
            limit_name(_lab_machines(lab_cluster, node)[node])
        )
        assert limit.active_slots == 1  # the slot passed over, not taken twice
    assert release_nodes("lab-takeover", [node], "lab-new-12345678") == [node]


@pytest.mark.lab
def test_a_finished_holder_whose_containers_remain_is_waited_for(
    prefect_harness: Path, lab_cluster: Lab, lab_engine_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = lab_cluster.nodes[1]
    _hold_with_ended_run(monkeypatch, lab_cluster, "lab-takeover", node, "lab-left-0badc0de")
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
                _lab_machines(lab_cluster, node),
                "lab-new-12345678",
                timeout_s=2,
                poll_s=0.5,
                containers_on=_containers_on(lab_cluster),
            )
    finally:
        runner.run(["docker", "rm", "--force", name], timeout=60)
    holder = holders("lab-takeover", [node])[node]
    assert holder is not None
    assert holder.deployment_id == "lab-left-0badc0de"
    # Once the leftover is gone, the same deploy takes the node over.
    assert acquire_nodes(
        "lab-takeover",
        _lab_machines(lab_cluster, node),
        "lab-new-12345678",
        timeout_s=10,
        containers_on=_containers_on(lab_cluster),
    ) == [node]
    release_nodes("lab-takeover", [node], "lab-new-12345678")


def test_a_machine_id_file_is_checked() -> None:
    assert parse_machine_id("n1", "3d1219c7c4c5404aaa1f6d2a48adfda4\n") == (
        "3d1219c7c4c5404aaa1f6d2a48adfda4"
    )
    for content in ("", "uninitialized\n", "3D1219C7C4C5404AAA1F6D2A48ADFDA4"):
        with pytest.raises(
            RemoteError, match=r"node n1: /etc/machine-id holds .*systemd-machine-id"
        ):
            parse_machine_id("n1", content)


@pytest.mark.lab
def test_each_lab_node_is_a_machine_of_its_own(lab_cluster: Lab) -> None:
    found = machine_ids(lab_cluster.ssh_targets())
    assert found == {node: lab_cluster.layout.machine_id(node) for node in lab_cluster.nodes}
    assert len(set(found.values())) == len(found)
    assert Path("/etc/machine-id").read_text().strip() not in found.values()
    # Two entries for one machine (as an IP and a name would be) are refused, both named.
    target = lab_cluster.ssh_target("node1")
    twice = {"a": target, "b": dataclasses.replace(target, connect_timeout_s=11)}
    with pytest.raises(RemoteError, match=r"nodes a, b have one machine id .*names one machine"):
        machine_ids(twice)


def _alias_inventory(lab: Lab, aliases: dict[str, str]) -> Path:
    """A second inventory of the lab's machines: another cluster name, other node names."""
    text = lab.inventory_path.read_text().replace(
        f"name = {json.dumps(lab.name)}", f'name = "{lab.name}-alias"', 1
    )
    for node, alias in aliases.items():
        text = text.replace(f'name = "{node}"', f'name = "{alias}"')
    path = lab.inventory_path.with_name("alias.toml")  # beside the key files it names
    path.write_text(text)
    return path


@pytest.mark.lab
def test_two_inventories_naming_one_machine_share_its_lock(
    prefect_harness: Path, lab_cluster: Lab
) -> None:
    recipe = load_recipe(find_recipe("lab-single"))
    first = make_plan(recipe, load_cluster(lab_cluster.inventory_path), ["node3"])
    alias = load_cluster(_alias_inventory(lab_cluster, {"node3": "spark-c"}))
    second = make_plan(recipe, alias, ["spark-c"])
    assert first.deployment_id != second.deployment_id
    first_machines = machine_ids(plan_targets(first))
    second_machines = machine_ids(plan_targets(second))
    assert first_machines["node3"] == second_machines["spark-c"]

    assert acquire_nodes(first.cluster, first_machines, first.deployment_id) == ["node3"]
    waits: list[str] = []
    taken: list[list[str]] = []
    second_deploy = threading.Thread(
        target=lambda: taken.append(
            acquire_nodes(
                second.cluster,
                second_machines,
                second.deployment_id,
                timeout_s=60,
                poll_s=0.2,
                log=waits.append,
            )
        )
    )
    second_deploy.start()
    try:
        while not waits and second_deploy.is_alive():
            time.sleep(0.05)
        assert not taken
        assert (
            f"spark-c is held by deployment {first.deployment_id} (as node3 of cluster"
            in (waits[0])
        )
    finally:
        release_nodes(first.cluster, ["node3"], first.deployment_id)
        second_deploy.join(timeout=70)
    assert taken == [["spark-c"]]
    holder = holders(second.cluster, ["spark-c"])["spark-c"]
    assert holder is not None
    assert holder.deployment_id == second.deployment_id
    assert holders(first.cluster, ["node3"]) == {"node3": None}
    machine = first_machines["node3"]
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(f"node:{machine[:12]}")
        assert limit.active_slots == 1
        record = client.read_variable_by_name(f"node-lock-{machine[:12]}")
    assert record is not None
    assert record.value == {
        "deployment_id": second.deployment_id,
        "since": holder.since,
        "flow_run_id": None,
        "cluster": alias.name,
        "node": "spark-c",
        "machine_id": machine,
    }
    assert release_nodes(second.cluster, ["spark-c"], second.deployment_id) == ["spark-c"]


def test_holders_and_release_go_by_the_records_and_skip_old_ones(prefect_harness: Path) -> None:
    # A record of the locks keyed by node name (before they were per machine) is no holder.
    with get_client(sync_client=True) as client:
        client.create_variable(
            VariableCreate(
                name="node-lock-old-n1-0badc0de",
                value={"deployment_id": "dep-old", "since": "2025-01-01T00:00:00+00:00"},
                tags=records.HOLDER_TAGS,
            )
        )
    assert holders("rec", ["n1"]) == {"n1": None}
    assert acquire_nodes("rec", machines("rec", "n1"), "dep-r", timeout_s=5) == ["n1"]
    holder = holders("rec", ["n1"])["n1"]
    assert holder is not None
    assert holder.machine_id == machines("rec", "n1")["n1"]
    assert release_nodes("rec", ["n1"], "dep-old") == []
    assert release_nodes("rec", ["n1"], "dep-r") == ["n1"]
    assert holders("rec", ["n1"]) == {"n1": None}


@pytest.mark.parametrize(
    "failure",
    [httpx.ConnectError("the API went away"), KeyboardInterrupt()],
    ids=["api-failure", "interrupted"],
)
def test_a_failure_between_taking_the_slots_and_recording_them_gives_them_back(
    prefect_harness: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    """The window between the slots' increment and the holder records: the slots just taken go
    back and the records written go, so no unrecorded holder is left for every deploy to wait
    on."""
    cluster = f"window-{type(failure).__name__.lower()}"
    nodes = machines(cluster, "n1", "n2", "n3")
    written: list[str] = []

    def failing_on_the_second(client: object, holder: NodeHolder) -> None:
        if written:
            raise failure
        records._write_holder(client, holder)  # type: ignore[arg-type]
        written.append(holder.node)

    # The undo meets a failure of its own once, and tries again.
    give_backs: list[list[str]] = []

    def giving_back_on_the_second_try(client: object, held: list[str], since: str) -> None:
        give_backs.append(held)
        if len(give_backs) == 1:
            raise httpx.ReadTimeout("the API is slow")
        slots._give_back_slots(client, held, since)  # type: ignore[arg-type]

    monkeypatch.setattr(acquire, "_write_holder", failing_on_the_second)
    monkeypatch.setattr(acquire, "_give_back_slots", giving_back_on_the_second_try)
    with pytest.raises(type(failure)):
        acquire_nodes(cluster, nodes, "dep-window", timeout_s=5)
    monkeypatch.undo()
    assert written == ["n1"]
    assert give_backs == [list(nodes.values())] * 2
    with get_client(sync_client=True) as client:
        for node, machine in nodes.items():
            limit = client.read_global_concurrency_limit_by_name(limit_name(machine))
            assert limit.active_slots == 0, node
    assert holders(cluster, list(nodes)) == dict.fromkeys(nodes)
    # Free at once: no wait for a holder nobody recorded.
    assert acquire_nodes(cluster, nodes, "dep-after", timeout_s=0) == list(nodes)
    assert release_nodes(cluster, list(nodes), "dep-after") == list(nodes)
