"""The `deploy` flow: a recipe onto a cluster's nodes, from the NAS to a smoke-tested endpoint.

Composition only: every step is a task (tasks/), every decision is in sparkdeploy/.
"""

from __future__ import annotations

from typing import Any, Literal

from prefect import flow
from prefect.futures import PrefectFuture

from sparkdeploy.summary import DeploySummary, StepClock
from tasks.boot import boot_deployment
from tasks.compose_model import compose_model_on_node
from tasks.gate import readiness_gate
from tasks.images import ensure_images
from tasks.plan import plan_deployment
from tasks.prefetch import prefetch_repos
from tasks.runlabels import label_flow_run
from tasks.smoke import smoke_test
from tasks.stage_engram import stage_engram_on_node
from tasks.summary import publish_summary
from tasks.teardown import teardown_deployment

# Steps a deploy may skip, e.g. skip=["prefetch"] when the NAS is known to be complete.
Step = Literal["prefetch", "stage", "image", "compose", "smoke"]


@flow(
    name="deploy",
    flow_run_name="deploy {recipe} on {cluster}",
    description="Plan, prefetch, stage, image, compose, boot, readiness gate, smoke test.",
    log_prints=False,
)
def deploy(
    recipe: str,
    cluster: str = "lab",
    nodes: list[str] | None = None,
    skip: list[Step] | None = None,
    allow_blocked: bool = False,
    keep_on_failure: bool = False,
    lock_timeout_s: float = 600.0,
) -> DeploySummary:
    """Deploy `recipe` on `cluster` (its first required_nodes nodes unless `nodes` names them).

    A failure after the boot tears the deployment down unless keep_on_failure is set. A node
    held by another deployment is waited for up to lock_timeout_s.
    """
    skipped = set(skip or ())
    clock = StepClock()
    with clock.step("plan"):
        plan = plan_deployment(recipe, cluster, nodes, allow_blocked=allow_blocked)
    label_flow_run(plan)
    # The run's tags (recipe, cluster, nodes) are on the flow run (label_flow_run), not on each
    # task run: a tagged task run asks Prefect for its tag concurrency slots before it starts,
    # which stalled warm deploys for seconds.
    if "prefetch" not in skipped:
        with clock.step("prefetch"):
            prefetch_repos(plan.repos, plan.nas_hf_cache, plan.hub_endpoint)
    with clock.step("stage, image, compose"):
        futures: list[PrefectFuture[Any]] = []
        if "image" not in skipped:
            futures.append(ensure_images.submit(plan))
        for node in plan.nodes:
            staged = (
                [] if "stage" in skipped else [stage_engram_on_node.submit(node, plan.nas_hf_cache)]
            )
            if "compose" in skipped:
                futures += staged
            else:
                futures.append(
                    compose_model_on_node.submit(
                        node, plan.nas_hf_cache, wait_for=staged, return_state=False
                    )
                )
        for future in futures:
            future.result()
    with clock.step("boot"):
        boot_deployment(plan, lock_timeout_s=lock_timeout_s)
    try:
        with clock.step("readiness"):
            gate = readiness_gate(plan)
        if "smoke" not in skipped:
            with clock.step("smoke"):
                smoke_test(plan)
    except BaseException:
        if not keep_on_failure:
            teardown_deployment(plan.deployment_id, plan.cluster)
        raise
    summary = DeploySummary.of(plan, clock.durations(), ready_after_s=gate.ready_after_s)
    publish_summary(summary)
    return summary
