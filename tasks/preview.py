"""Prefect task: what a deploy of the plan would do now, read without changing anything (logic
in sparkdeploy.steps.preview); a markdown artifact `preview-<deployment id>`."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import Plan
from sparkdeploy.spec.project import find_cluster
from sparkdeploy.steps.preview import Preview, preview
from tasks.artifacts import publish_markdown
from tasks.common import artifact_key
from tasks.prefetch import hub_access


@task(name="preview", task_run_name="preview {plan.deployment_id}")
def preview_deployment(
    plan: Plan,
    cluster: str,
    *,
    replace: bool = False,
    update_revisions: bool = False,
    lock_timeout_s: float = 600.0,
) -> Preview:
    """Per step and node, what `deploy` with these parameters would do now (`cluster`: the
    inventory's name or path, whose rates time it). No retries: it changes nothing, and a node
    or hub that does not answer is a row that says so."""
    logger = get_run_logger()
    hub = hub_access(plan.hub_endpoint, allow_http_token=plan.hub_allow_http_token)
    result = preview(
        plan,
        load_cluster(find_cluster(cluster)),
        hub,
        replace=replace,
        update_revisions=update_revisions,
        lock_timeout_s=lock_timeout_s,
    )
    for row in result.rows:
        logger.info(
            "%s, %s, %s: %s; %s %s",
            row.step,
            row.node,
            row.subject,
            row.action,
            row.detail,
            row.timing,
        )
    logger.info("%s", result.verdict)
    publish_markdown(
        key=artifact_key("preview", plan.deployment_id),
        markdown=result.markdown(),
        description=f"What a deploy of {plan.deployment_id} would do: {result.verdict}",
    )
    return result
