"""Prefect task: the deploy's summary as a markdown artifact."""

from __future__ import annotations

from prefect import task

from sparkdeploy.steps.summary import DeploySummary
from tasks.artifacts import publish_markdown
from tasks.common import artifact_key


@task(name="summary")
def publish_summary(summary: DeploySummary) -> None:
    publish_markdown(
        key=artifact_key("deploy", summary.deployment_id),
        markdown=summary.markdown(),
        description=f"{summary.recipe} on {summary.cluster}: {summary.endpoint}",
    )
