"""Prefect task: a deployment's containers removed, logs kept, node locks released
(logic in sparkdeploy.teardown and sparkdeploy.locks)."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.logging import get_run_logger

from sparkdeploy.cluster import load_cluster
from sparkdeploy.errors import TransientRemoteError
from sparkdeploy.locks import release_nodes
from sparkdeploy.project import find_cluster
from sparkdeploy.targets import cluster_targets
from sparkdeploy.teardown import TeardownReport, teardown
from tasks.common import artifact_key, retry_only


def _excerpt_markdown(report: TeardownReport) -> str:
    if not report.removed:
        return f"Deployment `{report.deployment_id}`: no containers were running."
    parts = [f"# Teardown of `{report.deployment_id}`"]
    for container in report.removed:
        parts.append(
            f"## {container.node}: `{container.name}` ({container.status}, exit"
            f" {container.exit_code})\nFull log: `{container.log_path}`"
            f" ({container.log_bytes} bytes)\n\n```\n" + "\n".join(container.excerpt) + "\n```"
        )
    return "\n\n".join(parts)


@task(
    name="teardown",
    retries=2,
    retry_delay_seconds=[5, 30],
    retry_condition_fn=retry_only(TransientRemoteError),
)
def teardown_deployment(deployment_id: str, cluster: str) -> TeardownReport:
    """Every node of the cluster searched for the deployment's containers (by label): logged to
    the NAS, removed; then the node locks it holds released. A second run finds nothing."""
    logger = get_run_logger()
    inventory = load_cluster(find_cluster(cluster))
    report = teardown(
        deployment_id, cluster_targets(inventory), inventory.nas.runs_dir, log=logger.info
    )
    release_nodes(
        inventory.name, [node.name for node in inventory.nodes], deployment_id, log=logger.info
    )
    create_markdown_artifact(
        key=artifact_key("teardown", deployment_id),
        markdown=_excerpt_markdown(report),
        description=f"Container log excerpts of {deployment_id}",
    )
    return report
