"""SSH targets of plan and inventory nodes (kept out of plan.py and cluster.py, which must not
import paramiko: `sparkdeploy validate` stays fast)."""

from __future__ import annotations

from sparkdeploy.remote.ssh import SshTarget
from sparkdeploy.spec.cluster import Cluster
from sparkdeploy.spec.plan import NodePlan, Plan, ssh_spec


def node_target(node: NodePlan) -> SshTarget:
    return SshTarget(**node.ssh.model_dump())


def plan_targets(plan: Plan) -> dict[str, SshTarget]:
    """SSH targets of a plan's nodes, in rank order."""
    return {node.node: node_target(node) for node in plan.nodes}


def cluster_targets(cluster: Cluster) -> dict[str, SshTarget]:
    """SSH targets of every node of a cluster, in inventory order."""
    return {node.name: SshTarget(**ssh_spec(cluster, node).model_dump()) for node in cluster.nodes}
