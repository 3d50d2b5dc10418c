"""Prefect task: whether the plan's deployment already runs as planned and answers (logic in
sparkdeploy.steps.running_copy)."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.errors import TransientRemoteError
from sparkdeploy.remote.engine_http import probe_endpoint
from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.image.source import build_context, image_source
from sparkdeploy.steps.running_copy import RunningCopy, judge_running_copy, node_facts
from sparkdeploy.steps.status import HEALTH_TIMEOUT_S
from tasks.common import retried_on


@task(
    name="running-copy",
    task_run_name="running-copy {plan.deployment_id}",
    **retried_on(TransientRemoteError, 5, 5),
)
def check_running_copy(plan: Plan) -> RunningCopy:
    """absent, different (recipe, revisions or image changed), unhealthy, or serving as planned."""
    facts = node_facts(plan)
    # An image built elsewhere (its docker_image_dir not in this checkout) is judged by its ID.
    image_dir, _ = image_source(plan.recipe, plan.docker_image_dir)
    context = build_context(image_dir).digest if image_dir else None
    found = any(node.containers for node in facts.values())
    outcome = (
        probe_endpoint(
            plan.endpoint, plan.served_model_name, timeout=HEALTH_TIMEOUT_S, api_key=plan.api_key
        )
        if found
        else None
    )
    copy = judge_running_copy(plan, facts, context_digest=context, probe_outcome=outcome)
    get_run_logger().info("%s: %s (%s)", plan.deployment_id, copy.state, copy.reason)
    return copy
