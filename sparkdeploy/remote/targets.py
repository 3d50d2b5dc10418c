"""SSH targets of plan and inventory nodes (kept out of plan.py and cluster.py, which must not
import paramiko: `sparkdeploy validate` stays fast)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from sparkdeploy.remote.docker_cli import on_nodes
from sparkdeploy.remote.runner import Runner
from sparkdeploy.remote.ssh import SshTarget
from sparkdeploy.spec.cluster import Cluster
from sparkdeploy.spec.plan import NodePlan, Plan, ssh_spec

T = TypeVar("T")


def node_target(node: NodePlan) -> SshTarget:
    return SshTarget(**node.ssh.model_dump())


def plan_targets(plan: Plan) -> dict[str, SshTarget]:
    """SSH targets of a plan's nodes, in rank order."""
    return {node.node: node_target(node) for node in plan.nodes}


def on_plan_nodes(nodes: Sequence[NodePlan], work: Callable[[Runner, NodePlan], T]) -> dict[str, T]:
    """work(connection, node's plan) on each of these plan nodes at once, by node name."""
    by_name = {node.node: node for node in nodes}
    return on_nodes(
        {name: node_target(node) for name, node in by_name.items()},
        lambda runner, name: work(runner, by_name[name]),
    )


def cluster_targets(cluster: Cluster) -> dict[str, SshTarget]:
    """SSH targets of every node of a cluster, in inventory order."""
    return {node.name: SshTarget(**ssh_spec(cluster, node).model_dump()) for node in cluster.nodes}
