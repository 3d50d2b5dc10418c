"""Prefect task: the composed model dir of one node (logic in sparkdeploy.compose)."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger

from sparkdeploy.compose import ComposeResult, compose_model
from sparkdeploy.errors import TransientRemoteError
from sparkdeploy.plan import NodePlan
from sparkdeploy.ssh import cached_connection
from sparkdeploy.targets import node_target
from tasks.common import artifact_key, retry_only


@task(
    name="compose-model",
    retries=3,
    retry_delay_seconds=[5, 30, 120],
    retry_condition_fn=retry_only(TransientRemoteError),
)
def compose_model_on_node(node: NodePlan, nas_hf_cache: str) -> ComposeResult | None:
    """The node's composed HF cache built, rebuilt or found unchanged; None if it has none."""
    logger = get_run_logger()
    composed = node.composed
    if composed is None:
        logger.info("node %s: the recipe composes no model", node.node)
        return None
    result = compose_model(
        cached_connection(node_target(node)),
        node.node,
        root=composed.root,
        nas_hf_cache=nas_hf_cache,
        sources=[(source.repo, source.revision) for source in composed.sources],
        local_files=composed.local_files,
    )
    logger.info(
        "node %s: composed model %s %s (%s), %d local files hardlinked, mounted at %s",
        node.node,
        result.root,
        result.status,
        ", ".join(f"{repo}@{commit[:12]}" for repo, commit in result.sources),
        len(result.hardlinks),
        composed.mount,
    )
    create_table_artifact(
        key=artifact_key("composed-model", node.node),
        table=[
            {
                "node": node.node,
                "root": result.root,
                "status": result.status,
                "entry": entry,
                "local_file": local,
            }
            for local, entry in result.hardlinks
        ],
        description=f"Local files hardlinked into the composed model on {node.node}",
    )
    return result
