"""The `deploy` flow: a recipe onto a cluster's nodes, from the NAS to a smoke-tested endpoint.

Composition only: every step is a task (tasks/), every decision is in sparkdeploy/.
"""

from __future__ import annotations

from typing import Literal

from prefect import flow

from sparkdeploy.steps.summary import DeploySummary, StepClock
from tasks.boot import boot_deployment
from tasks.compose_model import compose_models_on_nodes
from tasks.fit import check_fit
from tasks.hold_nodes import hold_nodes, let_go_of_nodes
from tasks.image import ensure_images
from tasks.plan import plan_deployment
from tasks.prefetch import prefetch_repos
from tasks.readiness_gate import readiness_gate
from tasks.runlabels import label_flow_run
from tasks.smoke_test import smoke_test
from tasks.stage_engram import stage_engram_on_nodes
from tasks.summary import publish_summary
from tasks.teardown import tear_down_cancelled_run, teardown_deployment

# Steps a deploy may skip, e.g. skip=["prefetch"] when the NAS is known to be complete, or
# skip=["fit"] for a model the fit check sizes wrongly (docs/field.md#memory-fit).
Step = Literal["prefetch", "fit", "stage", "image", "compose", "smoke"]


@flow(
    name="deploy",
    flow_run_name="deploy {recipe} on {cluster}",
    description="Plan, prefetch, fit, stage, image, compose, boot, readiness gate, smoke test.",
    log_prints=False,
    # Cancelled from the UI or `prefect flow-run cancel`: nothing of the run is left running.
    on_cancellation=[tear_down_cancelled_run],
)
def deploy(
    recipe: str,
    cluster: str,
    nodes: list[str] | None = None,
    skip: list[Step] | None = None,
    allow_blocked: bool = False,
    keep_on_failure: bool = False,
    lock_timeout_s: float = 600.0,
) -> DeploySummary:
    """Deploy `recipe` on `cluster` (its first required_nodes nodes unless `nodes` names them).

    Once the NAS holds the model, the fit check refuses a recipe whose model, KV cache and
    engine cannot fit a node's memory. The nodes are held for the deployment before anything is
    put on them; a node held by
    another deployment is waited for up to lock_timeout_s. A failure from the boot on tears
    the deployment down and lets its nodes go, unless keep_on_failure is set and the containers
    started; an earlier failure lets go of the nodes this run took.
    """
    skipped = set(skip or ())
    clock = StepClock()
    booted = False
    with clock.step("plan"):
        plan = plan_deployment(recipe, cluster, nodes, allow_blocked=allow_blocked)
    label_flow_run(plan)
    # The run's tags (recipe, cluster, nodes) are on the flow run (label_flow_run), not on each
    # task run: a tagged task run asks Prefect for its tag concurrency slots before it starts,
    # which stalled warm deploys for seconds.
    # The nodes are held (waiting for another deployment if need be) while the NAS fills.
    held = hold_nodes.submit(plan, lock_timeout_s=lock_timeout_s)
    try:
        if "prefetch" not in skipped:
            with clock.step("prefetch"):
                prefetch_repos(plan.repos, plan.nas_hf_cache, plan.hub_endpoint)
        if "fit" not in skipped:
            # Before anything is put on a node: a recipe that cannot fit is refused here.
            with clock.step("fit"):
                plan = check_fit(plan)
        with clock.step("hold nodes"):
            held.result()
        with clock.step("stage, image, compose"):
            # The image comes while the nodes stage and compose; each step fans out over nodes.
            image = None if "image" in skipped else ensure_images.submit(plan)
            if "stage" not in skipped:
                stage_engram_on_nodes(plan)
            if "compose" not in skipped:
                compose_models_on_nodes(plan)
            if image is not None:
                image.result()
    except BaseException:
        # Nothing of this run is running: it lets go of the nodes it took (once its wait for
        # them is over) and of no others: a running deployment it was to replace stays up.
        taken = held.result(raise_on_failure=False)
        if isinstance(taken, list) and taken:
            let_go_of_nodes(plan, taken)
        raise
    try:
        with clock.step("boot"):
            boot_deployment(plan)
        booted = True
        with clock.step("readiness"):
            gate = readiness_gate(plan)
        if "smoke" not in skipped:
            with clock.step("smoke"):
                smoke_test(plan)
    except BaseException:
        # A failed boot removed its containers; the nodes are let go whatever keep_on_failure
        # says, since nothing is left to inspect.
        if not (booted and keep_on_failure):
            teardown_deployment(plan.deployment_id, plan.cluster)
        raise
    summary = DeploySummary.of(
        plan, clock.durations(), ready_after_s=gate.ready_after_s, timeline=gate.timeline
    )
    publish_summary(summary)
    return summary
