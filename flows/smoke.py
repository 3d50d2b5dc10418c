"""The `smoke` flow: the watchdog that smoke-tests every deployment running on a cluster."""

from __future__ import annotations

from prefect import flow
from prefect.futures import wait

from sparkdeploy.steps.smoke_test import SmokeReport
from tasks.artifacts import artifacts_written
from tasks.smoke_test import smoke_test
from tasks.watchdog import failure_of, report_health, running_plans


@flow(
    name="smoke",
    flow_run_name="smoke watchdog on {cluster}",
    on_completion=[artifacts_written],
    on_failure=[artifacts_written],
)
def smoke(cluster: str) -> list[SmokeReport]:
    """Every running deployment smoke-tested, and its health a Prefect event
    (`sparkdeploy.deployment.healthy` / `.unhealthy` with the node and named cause) that
    automations act on; the run fails if any of them fails a check, with the node and cause
    named when the nodes show one (a worker died, the head exited)."""
    plans = running_plans(cluster)
    futures = [smoke_test.submit(plan) for plan in plans]
    wait(futures)
    reports = [
        report_health.submit(plan, cluster, failure_of(future))
        for plan, future in zip(plans, futures, strict=True)
    ]
    wait(reports)
    for report in reports:
        report.result()
    return [future.result() for future in futures]
