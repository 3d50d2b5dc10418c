"""Prefect task: the deploy's summary as a markdown artifact."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact

from sparkdeploy.steps.summary import DeploySummary
from tasks.common import artifact_key


@task(name="summary")
def publish_summary(summary: DeploySummary) -> None:
    create_markdown_artifact(
        key=artifact_key("deploy", summary.deployment_id),
        markdown=summary.markdown(),
        description=f"{summary.recipe} on {summary.cluster}: {summary.endpoint}",
    )
