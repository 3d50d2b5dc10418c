"""Prefect task: an automated repair counted against its hourly bound (logic in
sparkdeploy.steps.repair_budget)."""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import get_client, task
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterStartTime,
    FlowRunFilterTags,
)
from prefect.logging import get_run_logger
from prefect.runtime import flow_run

from sparkdeploy.errors import RepairLimitReached
from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.repair_budget import (
    REPAIR_NOT_NEEDED_TAG,
    REPAIR_TAG,
    WINDOW,
    EarlierRepair,
    deployment_tag,
    repair_refusal,
)
from tasks.runlabels import tag_flow_run


@task(name="repair-budget", task_run_name="repair-budget {plan.deployment_id}")
def start_repair(plan: Plan, cause: str, *, per_hour: int) -> None:
    """RepairLimitReached when `per_hour` repairs of the deployment started within the past
    hour; else this flow run is tagged as a repair (and counts for the next ones)."""
    now = datetime.now(UTC)
    current = flow_run.get_id()
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[REPAIR_TAG, deployment_tag(plan.deployment_id)]),
                start_time=FlowRunFilterStartTime(after_=now - WINDOW),
            )
        )
    earlier = [
        EarlierRepair(run.name, run.start_time)
        for run in runs
        if str(run.id) != current and run.start_time is not None
    ]
    refusal = repair_refusal(plan.deployment_id, cause, earlier, per_hour=per_hour, now=now)
    if refusal is not None:
        raise RepairLimitReached(refusal)
    tag_flow_run(REPAIR_TAG)
    get_run_logger().warning(
        "repairing %s (repair %d of at most %d an hour): %s",
        plan.deployment_id,
        len(earlier) + 1,
        per_hour,
        cause,
    )


@task(name="repair-budget-refund", task_run_name="repair-budget-refund {plan.deployment_id}")
def refund_repair(plan: Plan) -> None:
    """This repair found the deployment serving again (another repair, started by an earlier
    event of the same failure, redeployed it while this one waited for the nodes): it did
    nothing, so it does not count against the hourly bound."""
    tag_flow_run(REPAIR_NOT_NEEDED_TAG, untag=(REPAIR_TAG,))
    get_run_logger().info(
        "%s was redeployed while this repair waited: this run does not count as a repair",
        plan.deployment_id,
    )
