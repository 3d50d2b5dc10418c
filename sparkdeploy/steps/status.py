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
from sparkdeploy.remote.targets import cluster_targets
from sparkdeploy.report.history import NONE_YET, History
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
from sparkdeploy.spec.recipe import load_recipe
from sparkdeploy.steps.readiness_gate import probe_endpoint
from sparkdeploy.units import human_duration

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

    def uptime(self, now: datetime) -> str:
        """How long its oldest container has run (docker's StartedAt), or why it does not run."""
        stopped = [c for c in self.containers if c.status != "running"]
        if stopped:
            return ", ".join(f"{c.node} {c.status} ({c.exit_code})" for c in stopped)
        try:
            started = datetime.fromisoformat(self.since)
        except ValueError:
            return "unknown"
        return human_duration((now - started).total_seconds())

    def rows(self, now: datetime, history: History | None = None) -> list[dict[str, str]]:
        """One row per container; the deployment's own columns (health, uptime, last smoke
        test, last event) on its head's row."""
        return [
            {
                "deployment": self.deployment_id,
                "recipe": self.recipe,
                "node": c.node,
                "rank": str(c.rank),
                "container": c.name,
                "state": c.status if c.status == "running" else f"{c.status} ({c.exit_code})",
                "since": c.started_at,
                "health": self.health_and_fix if c.rank == 0 else "",
                "uptime": self.uptime(now) if c.rank == 0 else "",
                "last smoke test": (history.last_smoke if history else NONE_YET)
                if c.rank == 0
                else "",
                "last event": (history.last_event if history else NONE_YET) if c.rank == 0 else "",
            }
            for c in self.containers
        ]

    def line(self, now: datetime, history: History | None = None) -> str:
        """The deployment in one line, for the CLI."""
        nodes = ",".join(self.nodes)
        state = "healthy" if self.healthy else f"NOT healthy ({self.health_and_fix})"
        return (
            f"{self.deployment_id} ({self.recipe}) on {nodes}: {state}; up {self.uptime(now)};"
            f" last smoke test: {history.last_smoke if history else NONE_YET};"
            f" last event: {history.last_event if history else NONE_YET}"
        )


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
