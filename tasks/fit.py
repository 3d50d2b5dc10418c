"""Prefect task: the fit check, before anything is put on a node (logic in
sparkdeploy.steps.fit)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from sparkdeploy.errors import DoesNotFit
from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.fit import fit_report
from tasks.artifacts import publish_markdown
from tasks.common import artifact_key


# Its result holds the recipe's secrets: never persisted, never cached (tasks/common.py).
@task(name="fit", persist_result=False, cache_policy=NO_CACHE)
def check_fit(plan: Plan) -> Plan:
    """The plan with its fit figures; DoesNotFit, naming the figures and the knobs to turn, when
    the model, its KV cache and the engine cannot fit a node. No retries: its inputs are files.
    """
    logger = get_run_logger()
    report = fit_report(plan)
    publish_markdown(
        key=artifact_key("fit", plan.deployment_id),
        markdown=report.markdown(),
        description=f"{plan.recipe} on {plan.cluster}: memory fit",
    )
    logger.info("fit: %s", report.summary_line())
    for node in report.nodes:
        logger.info("fit: %s", node.line())
    for note in report.notes:
        logger.info("fit: %s", note)
    for warning in report.warnings:
        logger.warning("fit: %s", warning)
    if report.refusal is not None:
        raise DoesNotFit(report.refusal)
    return plan.model_copy(update={"fit": report})
