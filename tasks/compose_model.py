"""Prefect task: the composed model dir of every node (logic in sparkdeploy.steps.compose_model)."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.errors import TransientRemoteError
from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.compose_model import ComposeResult, compose_model
from tasks.artifacts import publish_table
from tasks.common import artifact_key, retried_on


@task(
    name="compose-model",
    **retried_on(TransientRemoteError, 5, 30, 120),
)
def compose_models_on_nodes(plan: Plan) -> dict[str, ComposeResult]:
    """Each node's composed HF cache built, rebuilt or found unchanged, all nodes at once (one
    task run for all, like stage-engram); nodes whose plan composes nothing are left out."""
    logger = get_run_logger()
    composing = {node.node: node.composed for node in plan.nodes if node.composed is not None}
    if not composing:
        logger.info("the recipe composes no model")
        return {}

    by_node = compose_model(plan)
    rows = []
    for name, result in by_node.items():
        logger.info(
            "node %s: composed model %s %s (%s), %d local files hardlinked, mounted at %s",
            name,
            result.root,
            result.status,
            ", ".join(f"{repo}@{commit[:12]}" for repo, commit in result.sources),
            len(result.hardlinks),
            composing[name].mount,
        )
        rows += [
            {
                "node": name,
                "root": result.root,
                "status": result.status,
                "entry": entry,
                "local_file": local,
            }
            for local, entry in result.hardlinks
        ]
    publish_table(
        key=artifact_key("compose-model", plan.deployment_id),
        table=rows,
        description=f"Local files hardlinked into the composed models of {plan.deployment_id}",
    )
    return by_node
