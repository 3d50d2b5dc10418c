"""Prefect task: the plan of a deployment (logic in sparkdeploy.model.project and
sparkdeploy.model.plan)."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.errors import InventoryError, RecipeBlocked
from sparkdeploy.model.cluster import load_cluster
from sparkdeploy.model.plan import Plan, make_plan
from sparkdeploy.model.project import find_cluster, find_recipe
from sparkdeploy.model.recipe import load_recipe


@task(name="plan")
def plan_deployment(
    recipe: str, cluster: str, nodes: list[str] | None = None, *, allow_blocked: bool = False
) -> Plan:
    """What the deployment will do on each node; fails before touching any node on bad input.

    No retries: every failure here is in a file (or a blocked recipe) and needs a person.
    """
    recipe_spec = load_recipe(find_recipe(recipe))
    reason = recipe_spec.blocked_reason
    if reason is not None and not allow_blocked:
        raise RecipeBlocked(
            f"recipe {recipe_spec.recipe_id} is blocked: {reason}\n"
            "Fix what the reason says, or deploy anyway with allow_blocked=true "
            "(`-p allow_blocked=true`)."
        )
    cluster_spec = load_cluster(find_cluster(cluster))
    missing = cluster_spec.missing_files()
    if missing:
        raise InventoryError("\n".join(missing))
    plan = make_plan(recipe_spec, cluster_spec, nodes)
    if reason is not None:
        get_run_logger().warning("deploying blocked recipe %s: %s", plan.recipe, reason)
    get_run_logger().info(
        "deployment %s: recipe %s on %s (%s), endpoint %s",
        plan.deployment_id,
        plan.recipe,
        plan.cluster,
        ", ".join(f"{node.node}=rank {node.rank}" for node in plan.nodes),
        plan.endpoint,
    )
    return plan
