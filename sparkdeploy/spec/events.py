"""The watchdog's Prefect events: a deployment found unhealthy (or healthy) by its smoke test.

Events follow Prefect's grammar (https://docs.prefect.io/v3/automate/events): the resource is
the deployment (`sparkdeploy.deployment.<id>`) with the recipe, cluster, its nodes and the node
the cause names as labels (strings, so automations can match them), and the payload says what
an automation needs to act: the named cause and its kind, and the deploy parameters that bring
the same deployment up again (recipe, cluster, nodes). prefect.yaml's trigger on the deploy
deployment and the notification automation (sparkdeploy.report.notify) read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparkdeploy.spec.plan import Plan

UNHEALTHY = "sparkdeploy.deployment.unhealthy"
HEALTHY = "sparkdeploy.deployment.healthy"
RESOURCE_PREFIX = "sparkdeploy.deployment."


@dataclass(frozen=True)
class Health:
    """What the watchdog found: healthy, or the node and named cause of the trouble."""

    healthy: bool
    node: str
    kind: str  # "healthy", a diagnosis kind (worker_died, head_exited, ...) or smoke_failed
    cause: str

    @classmethod
    def ok(cls, plan: Plan) -> Health:
        return cls(True, plan.head.node, "healthy", "every smoke check passed")


def resource_id(deployment_id: str) -> str:
    return f"{RESOURCE_PREFIX}{deployment_id}"


def health_event(plan: Plan, cluster: str, health: Health) -> dict[str, Any]:
    """emit_event's keyword arguments for `health` of the plan's deployment. `cluster` is the
    cluster as the watchdog was given it (a name or an inventory path), so that a deploy run
    with these parameters resolves the same inventory."""
    nodes = [node.node for node in plan.nodes]
    return {
        "event": HEALTHY if health.healthy else UNHEALTHY,
        "resource": {
            "prefect.resource.id": resource_id(plan.deployment_id),
            "prefect.resource.name": plan.deployment_id,
            "sparkdeploy.spec.recipe": plan.recipe,
            "sparkdeploy.spec.cluster": plan.cluster,
            "sparkdeploy.nodes": ",".join(nodes),
            "sparkdeploy.node": health.node,
        },
        "payload": {
            "deployment": plan.deployment_id,
            "recipe": plan.recipe,
            "cluster": cluster,
            "nodes": nodes,
            "node": health.node,
            "kind": health.kind,
            "cause": health.cause,
            "endpoint": plan.endpoint,
        },
    }
