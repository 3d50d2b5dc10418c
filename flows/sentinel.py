"""The `sentinel` flow: a cluster's deployments probed every few seconds for a bounded time.

A schedule keeps one alive (prefect.yaml: every 10 minutes, one at a time, a run due while one
goes cancelled); each run ends `run_for_s` after the time it was scheduled for, so that it has
ended when the next one is due, even when it started late. Why a flow of its own rather than
probes in the watchdog: docs/architecture.md#the-sentinel.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prefect import flow
from prefect.logging import get_run_logger
from prefect.runtime import flow_run

from sparkdeploy.steps.sentinel import WatchRecord
from tasks.artifacts import artifacts_written
from tasks.sentinel import watch_cluster


@flow(
    name="sentinel",
    flow_run_name="sentinel on {cluster}",
    on_completion=[artifacts_written],
    on_failure=[artifacts_written],
)
def sentinel(cluster: str, run_for_s: float = 570.0) -> list[WatchRecord]:
    """Every deployment running on the cluster probed (a one-token completion and its
    containers' states) every 3 s until run_for_s after this run's scheduled start;
    `sparkdeploy.deployment.unhealthy` emitted once when one stops serving (the repair
    automation acts on it), `.healthy` once when it serves again."""
    scheduled: datetime = flow_run.scheduled_start_time
    left = (scheduled + timedelta(seconds=run_for_s) - datetime.now(UTC)).total_seconds()
    if left <= 0:
        get_run_logger().warning(
            "started %.0f s after its scheduled time, past its %.0f s: the next run watches",
            -left + run_for_s,
            run_for_s,
        )
        return []
    return watch_cluster(cluster, left)
