"""Prefect task: the quality gate of a smoke-tested deployment, when its recipe has [quality]
(logic in sparkdeploy.steps.quality).

Retried only when the SSH connection to the head node was lost under an image eval: a score
past its threshold, or a tool that gives none, is the build's or the tool's, not the network's.
"""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.errors import TransientRemoteError
from sparkdeploy.report.quality import QualityReport
from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.quality import QualitySettings, run_quality
from tasks.common import publish_gate_report, retried_on


@task(
    name="quality-gate",
    task_run_name="quality-gate {plan.deployment_id}",
    **retried_on(TransientRemoteError, 10, 30),
)
def quality_gate(plan: Plan, *, raise_on_failure: bool = True) -> QualityReport:
    """Every eval of the recipe's [quality] against the endpoint; a table artifact
    (`quality-<deployment>`: each eval's score, threshold, samples and seconds); QualityFailed
    naming each eval that failed (unless raise_on_failure is off: the compare flow shows a score
    past its threshold as a finding)."""
    logger = get_run_logger()
    if plan.quality is None:
        logger.info("recipe %s has no [quality]: no quality gate", plan.recipe)
        return QualityReport(plan.served_model_name, plan.endpoint, ())
    settings = QualitySettings.for_plan(plan, plan.quality)
    logger.info(
        "quality gate of %r at %s: %s",
        plan.served_model_name,
        plan.endpoint,
        ", ".join(plan.quality.eval_names),
    )
    report = run_quality(settings)
    publish_gate_report(
        plan,
        report,
        ((result.passed, result.verdict()) for result in report.results),
        key="quality",
        title="Quality gate",
        unit="eval",
        raise_on_failure=raise_on_failure,
    )
    return report
