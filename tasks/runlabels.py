"""Run names and tags that make the UI's run history read as an operations log."""

from __future__ import annotations

from uuid import UUID

from prefect import get_client
from prefect.runtime import flow_run

from sparkdeploy.model.plan import Plan


def run_tags(plan: Plan) -> list[str]:
    return [
        f"recipe:{plan.recipe}",
        f"cluster:{plan.cluster}",
        *(f"node:{node.node}" for node in plan.nodes),
    ]


def label_flow_run(plan: Plan, verb: str = "deploy") -> None:
    """Name the current flow run `<verb> <recipe> on <cluster> [nodes]` and tag it likewise."""
    current_id = flow_run.get_id()
    if current_id is None:
        return
    run_id = UUID(current_id)
    nodes = ",".join(node.node for node in plan.nodes)
    with get_client(sync_client=True) as client:
        current = client.read_flow_run(run_id)
        client.update_flow_run(
            run_id,
            name=f"{verb} {plan.recipe} on {plan.cluster} [{nodes}]",
            tags=sorted({*(current.tags or []), *run_tags(plan)}),
        )
