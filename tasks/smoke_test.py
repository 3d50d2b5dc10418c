"""Prefect task: the smoke test of a ready deployment (logic in sparkdeploy.steps.smoke_test).

The checks that depend on the engine's flags (a tool call with --enable-auto-tool-choice,
reasoning with --reasoning-parser) are the plan's (Plan.tool_calls_enabled, reasoning_enabled).
No retries: a bad answer is the engine's, not the network's.
"""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.smoke_test import SmokeReport, SmokeSettings, run_smoke
from tasks.common import publish_gate_report


@task(name="smoke-test", task_run_name="smoke-test {plan.deployment_id}", retries=0)
def smoke_test(
    plan: Plan, request_timeout_s: float | None = None, *, raise_on_failure: bool = True
) -> SmokeReport:
    """Every smoke check against the endpoint; a table artifact; SmokeFailed if one failed
    (unless raise_on_failure is off: the compare flow reports a failed check as a result)."""
    logger = get_run_logger()
    settings = SmokeSettings.for_plan(plan, request_timeout_s=request_timeout_s)
    logger.info(
        "smoke test of %r at %s (tool call: %s, reasoning: %s, chat_template_kwargs: %s)",
        settings.served_model_name,
        settings.base_url,
        "yes" if settings.tool_calls else "no",
        "yes" if settings.reasoning else "no",
        dict(settings.chat_template_kwargs) or "none",
    )
    report = run_smoke(settings)
    publish_gate_report(
        plan,
        report,
        ((check.passed, f"{check.name}: {check.evidence}") for check in report.checks),
        key="smoke-test",
        title="Smoke test",
        unit="check",
        raise_on_failure=raise_on_failure,
    )
    return report
