"""Prefect task of the sentinel: the cluster's deployments probed every few seconds for a
bounded time, a transition to unhealthy (or back) a Prefect event, the last probes a Prefect
Variable for status (logic in sparkdeploy.steps.sentinel and sentinel_record; the events are the
watchdog's, sparkdeploy.spec.events)."""

from __future__ import annotations

import logging
from typing import Any

import httpx
from prefect import get_client, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.actions import VariableCreate, VariableUpdate
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.events import emit_event
from prefect.logging import get_run_logger

from sparkdeploy.remote.prefect_api import retried_when_busy, single_attempt_client
from sparkdeploy.report.history import sentinel_variable
from sparkdeploy.spec.cluster import Cluster, load_cluster
from sparkdeploy.spec.events import Health, health_event
from sparkdeploy.spec.plan import Plan
from sparkdeploy.spec.project import find_cluster
from sparkdeploy.steps.hold_nodes import ended_runs, holders
from sparkdeploy.steps.sentinel import ProbeResult, WatchRecord, run_sentinel
from sparkdeploy.steps.sentinel_record import ProbeLedger
from sparkdeploy.steps.status import cluster_status

# A teardown stops a deployment's containers (logs kept) before it removes them: from outside,
# a head that exits. It holds no node lock then, so its flow run is what says it is under way.
TEARDOWN_FLOW = "teardown"
_GOING = [StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]
RECORD_TAGS = ["sparkdeploy", "sentinel"]
# A write of the record that meets a busy server (SQLite's 503) is sent again for this long: a
# write on a transition is what status shows until the next, up to 30 s later.
RECORD_BUSY_RETRY_S = 5.0


def write_record(cluster: str, value: dict[str, Any]) -> None:
    """The sentinel's record of the cluster into its Variable (sparkdeploy.steps.sentinel_record),
    through the process's kept client (single_attempt_client): each write is one request, sent
    again only on a busy answer, for RECORD_BUSY_RETRY_S. The first write creates the Variable.
    Called from the ledger's writer thread, so a retry delays no probe."""
    name = sentinel_variable(cluster)
    with single_attempt_client() as client:
        try:
            retried_when_busy(
                RECORD_BUSY_RETRY_S, client.update_variable, VariableUpdate(name=name, value=value)
            )
        except httpx.HTTPStatusError as error:
            if error.response.status_code != 404:
                raise
            retried_when_busy(
                RECORD_BUSY_RETRY_S,
                client.create_variable,
                VariableCreate(name=name, value=value, tags=RECORD_TAGS),
            )


class PrefectReporter:
    """The sentinel's verdicts as the watchdog's events, its lines in the run's log, its last
    probes in the cluster's record for status; a deploy holding a node of the deployment, or any
    teardown going, defers the verdict. close() writes the record a last time."""

    def __init__(
        self, cluster: str, inventory: Cluster, logger: logging.Logger | logging.LoggerAdapter[Any]
    ) -> None:
        self._cluster = cluster  # as given: the repair deploys with the same name or path
        self._inventory = inventory
        self._logger = logger
        self._ledger = ProbeLedger(self._write_record)

    def busy(self, plan: Plan) -> str | None:
        nodes = [node.node for node in plan.nodes]
        try:
            by_node = holders(self._inventory.name, nodes)
            runs = {holder.flow_run_id for holder in by_node.values() if holder is not None}
            live = runs - ended_runs(runs)
            for node, holder in by_node.items():
                if holder is not None and holder.flow_run_id in live:
                    return (
                        f"{node} is held by flow run {holder.flow_run_id} (deploying"
                        f" {holder.deployment_id}), still going"
                    )
            with get_client(sync_client=True) as client:
                teardowns = client.read_flow_runs(
                    flow_filter=FlowFilter(name=FlowFilterName(any_=[TEARDOWN_FLOW])),
                    flow_run_filter=FlowRunFilter(
                        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=_GOING))
                    ),
                    limit=1,
                )
        except Exception as error:
            return f"Prefect cannot say whether a deploy is busy with it ({error!r})"
        if teardowns:
            return f"teardown flow run {teardowns[0].name} is going"
        return None

    def unhealthy(self, plan: Plan, result: ProbeResult, cause: str) -> None:
        emit_event(
            **health_event(plan, self._cluster, Health(False, result.node, result.kind, cause))
        )
        self._logger.error(
            "%s is unhealthy: %s on %s: %s", plan.deployment_id, result.kind, result.node, cause
        )

    def recovered(self, plan: Plan) -> None:
        health = Health(True, plan.head.node, "healthy", "the sentinel's probes pass again")
        emit_event(**health_event(plan, self._cluster, health))
        self._logger.info("%s is healthy again", plan.deployment_id)

    def probed(self, plan: Plan, result: ProbeResult, before: str, after: str) -> None:
        self._ledger.probed(plan.deployment_id, result, before, after)

    def log(self, message: str) -> None:
        self._logger.info("%s", message)

    def close(self) -> None:
        self._ledger.close()

    def _write_record(self, value: dict[str, Any]) -> None:
        try:
            write_record(self._inventory.name, value)
        except Exception as error:
            # The record is status's view; the probes and their events go on without it.
            self._logger.warning("the sentinel's record for status was not written: %r", error)


def watched_plans(inventory: Cluster) -> list[Plan]:
    """A plan per deployment of ours on the cluster (orphans cannot be redeployed: the smoke
    watchdog and status name them)."""
    return [status.plan for status in cluster_status(inventory) if status.plan is not None]


# Its result is small; the plans it reads hold secrets and stay inside (tasks/common.py).
@task(
    name="sentinel", task_run_name="sentinel {cluster}", persist_result=False, cache_policy=NO_CACHE
)
def watch_cluster(cluster: str, run_for_s: float) -> list[WatchRecord]:
    """Every deployment on the cluster probed every few seconds for run_for_s (new ones picked
    up, gone ones dropped), with one event per transition."""
    logger = get_run_logger()
    inventory = load_cluster(find_cluster(cluster))
    reporter = PrefectReporter(cluster, inventory, logger)
    try:
        records = run_sentinel(lambda: watched_plans(inventory), reporter, run_for_s=run_for_s)
    finally:
        reporter.close()
    for record in records:
        logger.info(
            "%s: %d probes, %d unhealthy and %d recovered events%s",
            record.deployment_id,
            record.probes,
            record.unhealthy_events,
            record.recovered_events,
            ", gone" if record.gone else "",
        )
    return records
