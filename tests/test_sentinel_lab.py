"""The sentinel on the lab (issue 24.1): recipes/lab-single deployed, the sentinel's logic run
in-process against the session's Prefect server while requests load the engine, then the head
container killed over SSH. No event in the healthy minute; the unhealthy event, read back from
the server's events, within 15 s of the kill, once."""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from lab_flows import ask, nothing_runs

from flows.deploy import deploy
from flows.teardown import teardown
from sparkdeploy.remote.ssh import cached_connection
from sparkdeploy.remote.targets import node_target
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.events import UNHEALTHY, resource_id
from sparkdeploy.spec.project import load_plan
from sparkdeploy.steps.sentinel import PROBE_INTERVAL_S, WatchRecord, run_sentinel
from tasks.sentinel import PrefectReporter, watched_plans

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]

HEALTHY_WINDOW_S = 60.0
DETECT_BUDGET_S = 15.0
# Detection budget plus the time the server may take to write an event it was sent.
EVENT_WAIT_S = DETECT_BUDGET_S + 15.0
# The flow's run: long enough for a cluster re-read (every 30 s) and a dozen probes.
RUN_FOR_S = 40.0


def unhealthy_events(deployment_id: str, since: datetime) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.events.filters import (
        EventFilter,
        EventNameFilter,
        EventOccurredFilter,
        EventResourceFilter,
    )

    with get_client(sync_client=True) as client:
        page = client.read_events(
            EventFilter(
                occurred=EventOccurredFilter(since=since),
                event=EventNameFilter(name=[UNHEALTHY]),
                resource=EventResourceFilter(id=[resource_id(deployment_id)]),
            ),
            limit=10,
        )
    return list(page.events)


def load(endpoint: str, model: str, stop: threading.Event) -> None:
    """Chat requests back to back until stopped: the engine serves while it is probed."""
    while not stop.is_set():
        try:
            ask(endpoint, model, "What is 127 * 43?", timeout_s=10)
        except (AssertionError, OSError):
            if not stop.is_set():
                raise


def test_the_sentinel_declares_a_killed_head_within_15_s_and_nothing_while_it_serves(
    cluster: str,
) -> None:
    from prefect.events.worker import EventsWorker

    plan = load_plan("lab-single", cluster)
    inventory = load_cluster(Path(cluster))
    deploy("lab-single", cluster=cluster)
    logger = logging.getLogger("sentinel-test")
    records: list[WatchRecord] = []
    started = datetime.now(UTC)
    sentinel = threading.Thread(
        target=lambda: records.extend(
            run_sentinel(
                lambda: watched_plans(inventory),
                PrefectReporter(cluster, inventory, logger),
                run_for_s=HEALTHY_WINDOW_S + EVENT_WAIT_S + 10,
            )
        )
    )
    stop_load = threading.Event()
    loaders = [
        threading.Thread(target=load, args=(plan.endpoint, plan.served_model_name, stop_load))
        for _ in range(2)
    ]
    try:
        sentinel.start()
        for loader in loaders:
            loader.start()
        time.sleep(HEALTHY_WINDOW_S)
        assert all(loader.is_alive() for loader in loaders), "the load stopped: engine failed"
        EventsWorker.drain_all()
        assert unhealthy_events(plan.deployment_id, started) == []
        stop_load.set()
        head = plan.nodes[0]
        killed = datetime.now(UTC)
        cached_connection(node_target(head)).run(
            ["docker", "kill", head.container.name], timeout=60
        )
        deadline = time.monotonic() + EVENT_WAIT_S
        while not (found := unhealthy_events(plan.deployment_id, started)):
            assert time.monotonic() < deadline, f"no unhealthy event within {EVENT_WAIT_S} s"
            EventsWorker.drain_all()
            time.sleep(0.5)
        sentinel.join()
    finally:
        stop_load.set()
        for loader in loaders:
            loader.join(timeout=20)
        sentinel.join(timeout=120)
        teardown("lab-single", cluster=cluster)
    [event] = found
    detected_s = (event.occurred - killed).total_seconds()
    print(
        f"\nsentinel: head killed, unhealthy event {detected_s:.1f} s later"
        f" ({event.payload['kind']} on {event.payload['node']}: {event.payload['cause']});"
        f" records: {records}"
    )
    assert 0 < detected_s <= DETECT_BUDGET_S
    assert event.payload["kind"] == "head_exited"
    assert event.payload["node"] == head.node
    assert event.payload["recipe"] == "lab-single"
    assert event.payload["cluster"] == cluster
    assert [record.unhealthy_events for record in records] == [1]
    nothing_runs(cluster)


def test_the_sentinel_flow_watches_for_its_bounded_time_and_says_what_it_cost(
    cluster: str,
) -> None:
    """The flow itself (its task, its bounded run) on a serving deployment, no load: no event,
    a probe every 3 s, and the ops host's CPU for it (the whole process: an upper bound)."""
    from flows.sentinel import sentinel as sentinel_flow

    plan = load_plan("lab-single", cluster)
    deploy("lab-single", cluster=cluster)
    started = datetime.now(UTC)
    try:
        cpu, wall = time.process_time(), time.monotonic()
        records = sentinel_flow(cluster, run_for_s=RUN_FOR_S)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    finally:
        teardown("lab-single", cluster=cluster)
    [record] = records
    print(
        f"\nsentinel flow: {wall:.1f} s, {record.probes} probes of {plan.deployment_id},"
        f" {cpu:.2f} CPU s: {cpu / wall * 3600:.0f} CPU s an hour per deployment (upper bound)"
    )
    assert RUN_FOR_S <= wall <= RUN_FOR_S + 15
    assert record.probes >= RUN_FOR_S / PROBE_INTERVAL_S - 2
    assert (record.unhealthy_events, record.recovered_events, record.gone) == (0, 0, False)
    assert unhealthy_events(plan.deployment_id, started) == []
    nothing_runs(cluster)
