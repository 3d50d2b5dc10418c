"""The `deploy` flow: a recipe onto a cluster's nodes, from the NAS to a smoke-tested endpoint.

Composition only: every step is a task (tasks/), every decision is in sparkdeploy/. From the
hold of the nodes to the smoke test the steps run in one Prefect transaction
(https://docs.prefect.io/v3/advanced/transactions): when a step fails, the rollback hooks of the
steps that completed undo them, latest first (boot's removes the containers it started,
hold-nodes' gives the nodes back), and a replacing deploy then brings back what it replaced.
A killed process runs no hook: what it leaves is taken over by the next deploy
(sparkdeploy.steps.hold_nodes, sparkdeploy.steps.replace).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Literal

from prefect import flow
from prefect.exceptions import CancelledRun
from prefect.futures import PrefectFuture
from prefect.transactions import transaction

from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.hold_nodes import Replaced
from sparkdeploy.steps.prefetch import RepoOutcome
from sparkdeploy.steps.readiness_gate import GateResult
from sparkdeploy.steps.replace import Replacement, bring_back
from sparkdeploy.steps.running_copy import RunningCopy
from sparkdeploy.steps.summary import DeploySummary, StepClock
from tasks.artifacts import artifacts_written
from tasks.boot import KEEP_ON_FAILURE, boot_deployment
from tasks.compose_model import compose_models_on_nodes
from tasks.fit import check_fit
from tasks.hold_nodes import hold_nodes
from tasks.image import check_image_source, ensure_images
from tasks.plan import plan_deployment
from tasks.prefetch import prefetch_repos
from tasks.quality import quality_gate
from tasks.readiness_gate import readiness_gate
from tasks.repair_budget import refund_repair, start_repair
from tasks.replace import commit, find_replacement, retire_replaced
from tasks.runlabels import label_flow_run
from tasks.running_copy import check_running_copy
from tasks.smoke_test import smoke_test
from tasks.stage_engram import stage_engram_on_nodes
from tasks.summary import publish_summary
from tasks.teardown import tear_down_abandoned_run

# Steps a deploy may skip, by their task names, e.g. skip=["prefetch"] when the NAS is known to be
# complete, or skip=["fit"] for a model the fit check sizes wrongly (docs/field.md#memory-fit);
# the compare flow skips the smoke test and the quality gate, and runs them itself.
Step = Literal[
    "prefetch", "fit", "stage-engram", "image", "compose-model", "smoke-test", "quality-gate"
]
# Bringing back a replaced deployment: its nodes are this run's already (given back by the
# rollback), so holding them again takes no wait.
BRING_BACK_LOCK_TIMEOUT_S = 60.0


@flow(
    name="deploy",
    flow_run_name="deploy {recipe} on {cluster}",
    description="Its steps: plan, prefetch, fit, hold-nodes, stage-engram, image, compose-model, "
    "boot, readiness-gate, smoke-test.",
    log_prints=False,
    # Cancelled from the UI or `prefect flow-run cancel`, or its process killed: nothing of the
    # run is left running, and its nodes are free.
    on_cancellation=[tear_down_abandoned_run],
    on_crashed=[tear_down_abandoned_run],
    on_completion=[artifacts_written],
    on_failure=[artifacts_written],
)
def deploy(
    recipe: str,
    cluster: str,
    nodes: list[str] | None = None,
    skip: list[Step] | None = None,
    allow_blocked: bool = False,
    keep_on_failure: bool = False,
    lock_timeout_s: float = 600.0,
    replace: bool = False,
    ensure: bool = False,
    repair_cause: str | None = None,
    repairs_per_hour: int = 2,
    update_revisions: bool = False,
) -> DeploySummary:
    """Deploy `recipe` on `cluster` (its first required_nodes nodes unless `nodes` names them).

    Once the NAS holds the model, the fit check refuses a recipe whose model, KV cache and
    engine cannot fit a node's memory. The nodes are held for the deployment before anything is
    put on them; a node held by another deployment is waited for up to lock_timeout_s. A failure
    from the boot on tears the deployment down and lets its nodes go, unless keep_on_failure is
    set and the containers started; an earlier failure lets go of the nodes this run took.

    replace: the deployments of ours on these nodes are replaced: they serve on while this one
    is prepared, and their containers are removed just before its boot; if it then fails its
    boot, readiness gate or smoke test, they are brought back (same recipe, same nodes) and the
    run fails saying "rolled back to X, which is serving again" (with keep_on_failure, the
    failed one is kept for a look instead, and nothing is brought back).
    ensure: when this very deployment (same recipe, revisions, image ID and nodes) already runs
    and passes the smoke test, nothing else is done; otherwise it is deployed, replacing what
    runs on its nodes. The default of scheduled deploys.
    repair_cause: set by the watchdog's automation to the unhealthy event's cause: ensure, and
    refused once repairs_per_hour repairs of this deployment started within the past hour.
    update_revisions: an unpinned repo (a branch, `main`) that the NAS holds already is moved to
    the branch's commit on the hub now; without it the deploy uses the commit the NAS has held
    since the repo first entered it, as every ensure and repair does.
    """
    skipped = set(skip or ())
    clock = StepClock()
    with clock.step("plan"):
        plan = plan_deployment(recipe, cluster, nodes, allow_blocked=allow_blocked)
    label_flow_run(plan)
    ensuring = ensure or repair_cause is not None
    replacement = find_replacement(plan, cluster) if replace or ensuring else Replacement.none()
    # Outside the transaction: a failed smoke test here is a finding, not a failed step.
    found = check_running_copy(plan) if ensuring else None
    if found is not None and found.serving and smoke_test(plan, return_state=True).is_completed():
        return _already_serving(plan, found, replacement, clock, "the smoke test passed")
    if repair_cause is not None:
        start_repair(plan, repair_cause, per_hour=repairs_per_hour)
    if plan.docker_image_dir is not None and "image" not in skipped:
        # An image that cannot be built here must already be on the nodes: refused now, not
        # after a prefetch of maybe hundreds of GB and the hold.
        check_image_source(plan)
    prefetched, fitted = _submit_nas_steps(plan, skipped, update_revisions)
    retiring = False
    try:
        with transaction() as deploy_transaction:
            deploy_transaction.set(KEEP_ON_FAILURE, keep_on_failure)
            plan = _hold(plan, prefetched, fitted, clock, lock_timeout_s, replacement)
            if found is not None:
                # Another deploy (a repair, say) may have redeployed it while this one waited.
                now = check_running_copy(plan)
                if now.made_to_serve_since(found):
                    return _already_serving(
                        plan,
                        now,
                        replacement,
                        clock,
                        "another deploy redeployed it while this one waited",
                        repairing=repair_cause is not None,
                    )
            _prepare(plan, skipped, clock)
            retiring = bool(replacement.replacing)
            if retiring:
                with clock.step("retire replaced"):
                    retire_replaced(plan, replacement, cluster)
            gate = _start(plan, skipped, clock)
            if replacement.replacing:
                commit(plan, replacement)
    except Exception as failure:
        # Before the replaced deployments were removed they serve on, and the rollback gave
        # their nodes back; a cancelled run leaves them to the next deploy.
        if not retiring or keep_on_failure or isinstance(failure, CancelledRun):
            raise
        rolled_back = bring_back(
            failure, plan, replacement.bring_back, lambda old: _bring_back(old, cluster)
        )
        raise rolled_back from failure
    summary = DeploySummary.of(
        plan,
        clock.durations(),
        ready_after_s=gate.ready_after_s,
        timeline=gate.timeline,
        head_figures=gate.figures,
    )
    publish_summary(summary)
    return summary


def _already_serving(
    plan: Plan,
    copy: RunningCopy,
    replacement: Replacement,
    clock: StepClock,
    how: str,
    *,
    repairing: bool = False,
) -> DeploySummary:
    """The ensure shortcut: the deployment serves as planned, so nothing else is done but
    committing the replacement found on its nodes and refunding a repair that was not needed."""
    if replacement.replacing:
        commit(plan, replacement)
    if repairing:
        refund_repair(plan)
    summary = DeploySummary.of(
        plan,
        clock.durations(),
        ready_after_s=None,
        note=f"Already serving: {copy.reason}; {how}. Nothing else was done.",
    )
    publish_summary(summary)
    return summary


def _submit_nas_steps(
    plan: Plan, skipped: AbstractSet[str], update_revisions: bool
) -> tuple[PrefectFuture[list[RepoOutcome]] | None, PrefectFuture[Plan] | None]:
    """The prefetch, then the fit check (it reads the safetensors headers in the NAS), submitted
    outside the transaction: only what touches the nodes is rolled back. None: skipped."""
    prefetched = (
        None
        if "prefetch" in skipped
        else prefetch_repos.submit(
            plan.repos,
            plan.nas_hf_cache,
            plan.hub_endpoint,
            allow_http_token=plan.hub_allow_http_token,
            update_revisions=update_revisions,
            include=plan.prefetch_include,
            exclude=plan.prefetch_exclude,
        )
    )
    fitted = (
        None
        if "fit" in skipped
        else check_fit.submit(plan, return_state=False, wait_for=[prefetched] if prefetched else [])
    )
    return prefetched, fitted


def _hold(
    plan: Plan,
    prefetched: PrefectFuture[list[RepoOutcome]] | None,
    fitted: PrefectFuture[Plan] | None,
    clock: StepClock,
    lock_timeout_s: float,
    replacement: Replacement,
) -> Plan:
    """The nodes held (waiting for another deployment if need be) while the NAS fills and the
    fit is checked; all are waited for before a failure of one rolls back, so that the rollback
    gives back what the hold took. Returns the plan with its fit figures."""
    held = hold_nodes.submit(plan, lock_timeout_s=lock_timeout_s, replacing=replacement.replacing)
    with clock.step("prefetch"):
        if prefetched is not None:
            prefetched.wait()
    with clock.step("fit"):
        if fitted is not None:
            fitted.wait()
    with clock.step("hold-nodes"):
        held.wait()
    if prefetched is not None:
        prefetched.result()
    if fitted is not None:
        plan = fitted.result()
    held.result()
    return plan


def _prepare(plan: Plan, skipped: AbstractSet[str], clock: StepClock) -> None:
    """Engram copies, composed models and the image on every node (each fans out over nodes)."""
    with clock.step("stage-engram, image, compose-model"):
        # The image comes while the nodes stage and compose.
        image = None if "image" in skipped else ensure_images.submit(plan)
        if "stage-engram" not in skipped:
            stage_engram_on_nodes(plan)
        if "compose-model" not in skipped:
            compose_models_on_nodes(plan)
        if image is not None:
            image.result()


def _start(plan: Plan, skipped: AbstractSet[str], clock: StepClock) -> GateResult:
    """Containers up, ready, smoke-tested, and through the recipe's quality gate if it has one."""
    with clock.step("boot"):
        boot_deployment(plan)
    with clock.step("readiness-gate"):
        gate = readiness_gate(plan)
    if "smoke-test" not in skipped:
        with clock.step("smoke-test"):
            smoke_test(plan)
    if plan.quality is not None and "quality-gate" not in skipped:
        with clock.step("quality-gate"):
            quality_gate(plan)
    return gate


def _bring_back(old: Replaced, cluster: str) -> Plan:
    """A replaced deployment up again on its nodes, from its recipe; in a transaction of its own,
    so a failure leaves nothing of it running and its nodes free."""
    plan = plan_deployment(old.recipe, cluster, list(old.nodes), allow_blocked=True)
    clock = StepClock()
    with transaction():
        hold_nodes(plan, lock_timeout_s=BRING_BACK_LOCK_TIMEOUT_S)
        _prepare(plan, set(), clock)
        _start(plan, set(), clock)
    return plan
