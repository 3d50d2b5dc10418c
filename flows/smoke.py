"""The `smoke` flow: the watchdog that smoke-tests every deployment running on a cluster."""

from __future__ import annotations

from prefect import flow

from sparkdeploy.smoke import SmokeReport
from tasks.smoke import smoke_test
from tasks.watchdog import running_plans


@flow(name="smoke", flow_run_name="smoke watchdog on {cluster}")
def smoke(cluster: str = "lab") -> list[SmokeReport]:
    """Every running deployment smoke-tested; the run fails if any of them fails a check."""
    futures = [smoke_test.submit(plan) for plan in running_plans(cluster)]
    return [future.result() for future in futures]
