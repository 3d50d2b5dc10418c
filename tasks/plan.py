"""Prefect task: the plan of a deployment (logic in sparkdeploy.spec.project and
sparkdeploy.spec.plan), its containers labelled with the keyed digest of their secret values.

The digest's key is the Prefect Secret block `sparkdeploy-secrets-digest-key`, made with random
bytes on first use: every worker of the Prefect server reads the same key (so they agree on the
labels), and no node holds it (so a label tells nothing of a value; docs/recipes.md#secrets).
"""

from __future__ import annotations

import contextlib
from secrets import token_hex
from typing import cast

from prefect import task
from prefect.blocks.system import Secret
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from sparkdeploy.errors import InventoryError, RecipeBlocked
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import Plan, make_plan, with_secrets_label
from sparkdeploy.spec.project import find_cluster, find_recipe
from sparkdeploy.spec.recipe_loading import load_recipe

SECRETS_DIGEST_KEY_BLOCK = "sparkdeploy-secrets-digest-key"


def secrets_digest_key() -> bytes:
    """The key of the secrets label (module docstring): the Secret block's value, the block
    made on first use."""
    try:
        # Prefect's dispatch types the call as maybe-a-coroutine; from sync code it is the block.
        block = cast(Secret[str], Secret.load(SECRETS_DIGEST_KEY_BLOCK))
    except ValueError:  # Prefect's answer for a block that does not exist
        # Another run may make it between the two calls: then its key is the one.
        with contextlib.suppress(ValueError):
            Secret(value=token_hex(32)).save(SECRETS_DIGEST_KEY_BLOCK)
        block = cast(Secret[str], Secret.load(SECRETS_DIGEST_KEY_BLOCK))
    return str(block.get()).encode()


# Its result holds the recipe's secrets: never persisted, never cached (tasks/common.py).
@task(name="plan", persist_result=False, cache_policy=NO_CACHE)
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
    if any(node.container.secret_env for node in plan.nodes):
        plan = with_secrets_label(plan, secrets_digest_key())
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
