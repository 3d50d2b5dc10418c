"""Run names and tags that make the UI's run history read as an operations log."""

from __future__ import annotations

from uuid import UUID

from prefect import get_client
from prefect.runtime import flow_run

from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.repair_budget import deployment_tag


def run_tags(plan: Plan) -> list[str]:
    return [
        f"recipe:{plan.recipe}",
        f"cluster:{plan.cluster}",
        deployment_tag(plan.deployment_id),
        *(f"node:{node.node}" for node in plan.nodes),
    ]


def label_flow_run(plan: Plan, verb: str = "deploy") -> None:
    """Name the current flow run `<verb> <recipe> on <cluster> [nodes]` and tag it likewise.

    Called first thing in a run, so the tags it started with (a deployment's, say) are the ones
    in its context: no need to read them back from the server.
    """
    current_id = flow_run.get_id()
    if current_id is None:
        return
    nodes = ",".join(node.node for node in plan.nodes)
    with get_client(sync_client=True) as client:
        client.update_flow_run(
            UUID(current_id),
            name=f"{verb} {plan.recipe} on {plan.cluster} [{nodes}]",
            tags=sorted({*flow_run.get_tags(), *run_tags(plan)}),
        )


def tag_flow_run(*tags: str, untag: tuple[str, ...] = ()) -> None:
    """Add tags to the current flow run (and take `untag` off it)."""
    current_id = flow_run.get_id()
    if current_id is None:
        return
    run_id = UUID(current_id)
    with get_client(sync_client=True) as client:
        current = client.read_flow_run(run_id)
        kept = {*(current.tags or []), *tags} - set(untag)
        client.update_flow_run(run_id, tags=sorted(kept))
