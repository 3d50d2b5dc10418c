"""What runs on a cluster's nodes: our deployments (found by label), their health, since when.

Containers carry the deployment, recipe, node and rank labels (sparkdeploy.spec.plan), so the
status and the watchdog re-plan a running deployment from its labels alone: no state outside the
nodes. Labels are untrusted (sparkdeploy.spec.labels): a container whose labels do not have our
form gets a row saying so and is never re-planned; a recipe label is only ever a name under
recipes/, and a deployment is ours only when its labels re-plan to its own deployment id.
A deployment of ours whose labels no longer re-plan (its recipe deleted, broken, or changed so
that it plans another deployment) is an orphan: listed with the teardown that removes it by its
deployment id, since a teardown of its recipe cannot plan it either.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from sparkdeploy.errors import SparkDeployError
from sparkdeploy.remote.docker_cli import ContainerInfo, list_containers, on_nodes
from sparkdeploy.remote.engine_http import probe_endpoint
from sparkdeploy.remote.targets import cluster_targets
from sparkdeploy.spec.cluster import Cluster
from sparkdeploy.spec.labels import (
    DEPLOYMENT_LABEL,
    NODE_LABEL,
    RANK_LABEL,
    RECIPE_LABEL,
    label_problems,
)
from sparkdeploy.spec.plan import Plan, make_plan
from sparkdeploy.spec.project import find_recipe_by_name
from sparkdeploy.spec.recipe_loading import load_recipe

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
    # For an orphan (its recipe can no longer plan it): the command that tears it down.
    teardown_command: str | None = None
    # False for a container labelled as ours whose labels are not of our form.
    ours: bool = True

    @property
    def endpoint(self) -> str | None:
        return self.plan.endpoint if self.plan else None

    @property
    def nodes(self) -> list[str]:
        return [container.node for container in self.containers]

    @property
    def since(self) -> str:
        return min((c.started_at for c in self.containers), default="")

    @property
    def health_and_fix(self) -> str:
        if self.teardown_command is None:
            return self.health
        return f"{self.health}; tear it down with `{self.teardown_command}`"

    @property
    def started(self) -> datetime | None:
        """When the last of its containers started (docker's StartedAt): the deployment has been
        whole since. None when one of them does not run, or a start time cannot be read."""
        if any(c.status != "running" for c in self.containers):
            return None
        try:
            return max(datetime.fromisoformat(c.started_at) for c in self.containers)
        except ValueError:
            return None

    @property
    def health_text(self) -> str:
        """`healthy`, or NOT healthy with the containers that do not run and what the endpoint
        said (or why it was not asked)."""
        if self.healthy:
            return "healthy"
        stopped = [
            f"{c.node}'s container {c.status} ({c.exit_code})"
            for c in self.containers
            if c.status != "running"
        ]
        return "NOT healthy: " + "; ".join([*stopped, self.health_and_fix])


def _not_ours(node: str, container: ContainerInfo, problems: list[str]) -> DeploymentStatus:
    """A row for a container whose labels are not of our form: shown, never re-planned."""
    row = NodeContainer(
        node=node,
        rank=0,
        name=container.name,
        status=container.status,
        exit_code=container.exit_code,
        started_at=container.started_at,
    )
    return DeploymentStatus(
        deployment_id=container.labels.get(DEPLOYMENT_LABEL, "?")[:80],
        recipe=container.labels.get(RECIPE_LABEL, "?")[:80],
        containers=[row],
        plan=None,
        healthy=False,
        health=f"labels are not ours ({'; '.join(problems)}): not re-planned, left alone",
        ours=False,
    )


def replan(cluster: Cluster, containers: list[ContainerInfo]) -> Plan:
    """The plan a deployment's containers were started from, read back from their labels
    (checked with sparkdeploy.spec.labels.label_problems); SparkDeployError when they do not
    re-plan to their own deployment id."""
    ordered = sorted(containers, key=lambda c: int(c.labels[RANK_LABEL]))
    deployment_id = ordered[0].labels[DEPLOYMENT_LABEL]
    recipe = load_recipe(find_recipe_by_name(ordered[0].labels[RECIPE_LABEL]))
    plan = make_plan(recipe, cluster, [c.labels[NODE_LABEL] for c in ordered])
    if plan.deployment_id != deployment_id:
        raise SparkDeployError(
            f"its containers' labels plan deployment {plan.deployment_id}, not {deployment_id}:"
            " they were not started by this recipe on these nodes"
        )
    return plan


def teardown_command(cluster: str, deployment_id: str) -> str:
    """The teardown of a deployment by its id, whatever its recipe says now."""
    return (
        f"prefect deployment run 'teardown/teardown' -p cluster={cluster}"
        f" -p deployment_id={deployment_id}"
    )


def cluster_status(cluster: Cluster) -> list[DeploymentStatus]:
    """Every deployment of ours on the cluster's nodes, with the head's health; a row for each
    container labelled as ours whose labels are not of our form."""
    found = on_nodes(
        cluster_targets(cluster),
        lambda runner, node: list_containers(runner, node, DEPLOYMENT_LABEL),
    )
    by_deployment: dict[str, list[ContainerInfo]] = defaultdict(list)
    statuses = []
    for node, containers in found.items():
        for container in containers:
            problems = label_problems(container.labels, node)
            if problems:
                statuses.append(_not_ours(node, container, problems))
            else:
                by_deployment[container.labels[DEPLOYMENT_LABEL]].append(container)
    for deployment_id, containers in sorted(by_deployment.items()):
        rows = sorted(
            (
                NodeContainer(
                    node=c.labels[NODE_LABEL],
                    rank=int(c.labels[RANK_LABEL]),
                    name=c.name,
                    status=c.status,
                    exit_code=c.exit_code,
                    started_at=c.started_at,
                )
                for c in containers
            ),
            key=lambda row: row.rank,
        )
        recipe = containers[0].labels[RECIPE_LABEL]
        try:
            plan = replan(cluster, containers)
        except SparkDeployError as error:
            statuses.append(
                DeploymentStatus(
                    deployment_id,
                    recipe,
                    rows,
                    None,
                    False,
                    f"orphan: cannot re-plan: {error}",
                    teardown_command(cluster.name, deployment_id),
                )
            )
            continue
        outcome = probe_endpoint(
            plan.endpoint, plan.served_model_name, timeout=HEALTH_TIMEOUT_S, api_key=plan.api_key
        )
        statuses.append(
            DeploymentStatus(deployment_id, recipe, rows, plan, outcome.ready, outcome.detail)
        )
    return statuses
