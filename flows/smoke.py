"""The `smoke` flow: the watchdog that smoke-tests every deployment running on a cluster."""

from __future__ import annotations

from prefect import flow

from sparkdeploy.steps.smoke_test import SmokeReport
from tasks.smoke_test import smoke_test
from tasks.watchdog import diagnose_deployment, running_plans


@flow(name="smoke", flow_run_name="smoke watchdog on {cluster}")
def smoke(cluster: str) -> list[SmokeReport]:
    """Every running deployment smoke-tested; the run fails if any of them fails a check, with
    the node and cause named when the nodes show one (a worker died, the head exited)."""
    plans = running_plans(cluster)
    futures = [smoke_test.submit(plan) for plan in plans]
    for plan, future in zip(plans, futures, strict=True):
        future.wait()
        if future.state.is_failed():
            diagnose_deployment(plan)
    return [future.result() for future in futures]
