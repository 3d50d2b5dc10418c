"""What runs on a cluster's nodes: our deployments (found by label), their health, since when.

Containers carry the deployment, recipe, node and rank labels (sparkdeploy.plan), so the status
and the watchdog re-plan a running deployment from its labels alone: no state outside the nodes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from sparkdeploy.cluster import Cluster
from sparkdeploy.docker_remote import (
    DEPLOYMENT_LABEL,
    NODE_LABEL,
    RANK_LABEL,
    ContainerInfo,
    list_containers,
    on_nodes,
)
from sparkdeploy.errors import SparkDeployError
from sparkdeploy.gate import probe_endpoint
from sparkdeploy.plan import LABEL_PREFIX, Plan, make_plan
from sparkdeploy.project import find_recipe
from sparkdeploy.recipe import load_recipe
from sparkdeploy.targets import cluster_targets

RECIPE_LABEL = f"{LABEL_PREFIX}recipe"
HEALTH_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class NodeContainer:
    node: str
    rank: int
    name: str
    status: str  # running, exited, ...
    exit_code: int
    started_at: str


@dataclass(frozen=True)
class DeploymentStatus:
    deployment_id: str
    recipe: str
    containers: list[NodeContainer]  # in rank order
    plan: Plan | None  # None when the recipe can no longer be planned
    healthy: bool
    health: str  # what the endpoint said, or why it was not asked

    @property
    def endpoint(self) -> str | None:
        return self.plan.endpoint if self.plan else None

    @property
    def nodes(self) -> list[str]:
        return [container.node for container in self.containers]

    @property
    def since(self) -> str:
        return min((c.started_at for c in self.containers), default="")

    def rows(self) -> list[dict[str, str]]:
        return [
            {
                "deployment": self.deployment_id,
                "recipe": self.recipe,
                "node": c.node,
                "rank": str(c.rank),
                "container": c.name,
                "state": c.status if c.status == "running" else f"{c.status} ({c.exit_code})",
                "since": c.started_at,
                "health": self.health if c.rank == 0 else "",
            }
            for c in self.containers
        ]


def _grouped(found: dict[str, list[ContainerInfo]]) -> dict[str, list[ContainerInfo]]:
    by_deployment: dict[str, list[ContainerInfo]] = defaultdict(list)
    for containers in found.values():
        for container in containers:
            by_deployment[container.labels[DEPLOYMENT_LABEL]].append(container)
    return by_deployment


def replan(cluster: Cluster, containers: list[ContainerInfo]) -> Plan:
    """The plan a deployment's containers were started from, read back from their labels."""
    ordered = sorted(containers, key=lambda c: int(c.labels.get(RANK_LABEL, "0")))
    recipe = load_recipe(find_recipe(ordered[0].labels[RECIPE_LABEL]))
    return make_plan(recipe, cluster, [c.labels[NODE_LABEL] for c in ordered])


def cluster_status(cluster: Cluster) -> list[DeploymentStatus]:
    """Every deployment of ours on the cluster's nodes, with the head's health."""
    found = on_nodes(
        cluster_targets(cluster),
        lambda runner, node: list_containers(runner, node, DEPLOYMENT_LABEL),
    )
    statuses = []
    for deployment_id, containers in sorted(_grouped(found).items()):
        rows = sorted(
            (
                NodeContainer(
                    node=c.labels.get(NODE_LABEL, "?"),
                    rank=int(c.labels.get(RANK_LABEL, "0")),
                    name=c.name,
                    status=c.status,
                    exit_code=c.exit_code,
                    started_at=c.started_at,
                )
                for c in containers
            ),
            key=lambda row: row.rank,
        )
        recipe = containers[0].labels.get(RECIPE_LABEL, "?")
        try:
            plan = replan(cluster, containers)
        except SparkDeployError as error:
            statuses.append(
                DeploymentStatus(
                    deployment_id, recipe, rows, None, False, f"cannot re-plan: {error}"
                )
            )
            continue
        outcome = probe_endpoint(plan.endpoint, plan.served_model_name, timeout=HEALTH_TIMEOUT_S)
        statuses.append(
            DeploymentStatus(deployment_id, recipe, rows, plan, outcome.ready, outcome.detail)
        )
    return statuses
