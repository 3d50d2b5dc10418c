"""The status view (`sparkdeploy status`, the status flow's artifact): per deployment, its health
now, healthy since, the sentinel's last probe, its last fault and cause, its repairs this hour,
its last smoke test and the bytes it leaves on each node.

What runs, and whether it answers, comes from the nodes (sparkdeploy.steps.status); what
happened to it from the Prefect server (sparkdeploy.report.history: events, runs, artifacts and
the sentinel's record, a handful of requests whatever the number of deployments); the bytes from
each node that runs one, measured there in one call (sparkdeploy.node.usage) while the server is
read.
"""

from __future__ import annotations

import json
import posixpath
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

from prefect.client.orchestration import SyncPrefectClient

from sparkdeploy.errors import RemoteError
from sparkdeploy.node import usage as node_usage
from sparkdeploy.remote.docker_cli import on_nodes
from sparkdeploy.remote.node_script import build_node_script, last_json_line
from sparkdeploy.remote.runner import Runner, stderr_text
from sparkdeploy.remote.targets import cluster_targets
from sparkdeploy.report.history import History, Sentinel, read_history, read_sentinel
from sparkdeploy.report.markdown import markdown_table
from sparkdeploy.report.text_table import text_table
from sparkdeploy.spec.cluster import Cluster
from sparkdeploy.steps.repair_budget import REPAIR_TAG, WINDOW, deployment_tag
from sparkdeploy.steps.status import DeploymentStatus, cluster_status
from sparkdeploy.units import human_bytes

# Walking a composed dir (symlinks, a few hardlinks) and stat'ing its local files: well under a
# second; the bound is for a node whose disk hangs.
USAGE_TIMEOUT_S = 60.0
COLUMNS = (
    "deployment",
    "nodes",
    "health",
    "healthy since",
    "last probe",
    "last fault",
    "repairs this hour",
    "last smoke test",
    "bytes on each node",
)
NOT_OURS = "not read: its labels are not ours"


@dataclass(frozen=True)
class NodeBytes:
    """What a deployment leaves on one node's disk (its composed dir and local files, each inode
    once), or why that is not known."""

    bytes: int | None
    composed: bool = False
    files: int = 0
    unknown: str = ""

    def text(self, node: str) -> str:
        if self.bytes is None:
            return f"{node} unknown ({self.unknown})"
        found = self.composed or self.files
        return f"{node} {human_bytes(self.bytes)}" + ("" if found else " (nothing staged)")


@cache
def usage_script() -> str:
    return build_node_script(node_usage)


def ask_usage(
    runner: Runner, node: str, deployments: Mapping[str, Mapping[str, Any]]
) -> dict[str, NodeBytes]:
    """What each deployment (its composed dir and local files) takes on the node, in one call;
    RemoteError when the script gives no answer."""
    completed = runner.run_python(
        usage_script(),
        [json.dumps({"deployments": deployments})],
        timeout=USAGE_TIMEOUT_S,
        check=False,
    )
    answer = last_json_line(completed.stdout)
    if answer is None or not answer.get("ok"):
        detail = answer["message"] if answer else stderr_text(completed) or "(no stderr)"
        raise RemoteError(f"node {node}: the usage script exited {completed.exit_code}: {detail}")
    return {
        dep: NodeBytes(int(found["bytes"]), bool(found["composed"]), int(found["files"]))
        for dep, found in answer["deployments"].items()
    }


def usage_requests(
    cluster: Cluster, statuses: Sequence[DeploymentStatus]
) -> dict[str, dict[str, dict[str, Any]]]:
    """node -> deployment -> its composed dir and local files there: the plan's, or for an
    orphan its dir by deployment id (whose key names its local files)."""
    requests: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for status in statuses:
        planned = {node.node: node.composed for node in status.plan.nodes} if status.plan else {}
        for node in status.nodes:
            composed = planned.get(node)
            requests[node][status.deployment_id] = {
                "root": composed.root
                if composed
                else posixpath.join(cluster.node_paths.composed_root, status.deployment_id),
                "local_files": composed.local_files if composed else [],
            }
    return requests


def measure_nodes(
    cluster: Cluster, statuses: Sequence[DeploymentStatus]
) -> dict[str, dict[str, NodeBytes]]:
    """deployment -> node -> what it leaves on that node's disk, one call per node at once; a
    node that cannot say is unknown, with why."""
    requests = usage_requests(cluster, statuses)
    targets = {
        node: target for node, target in cluster_targets(cluster).items() if node in requests
    }

    def measure(runner: Runner, node: str) -> dict[str, NodeBytes] | str:
        try:
            return ask_usage(runner, node, requests[node])
        except (RemoteError, OSError) as error:
            return str(error)

    try:
        answers: dict[str, dict[str, NodeBytes] | str] = on_nodes(targets, measure)
    except (RemoteError, OSError) as error:
        answers = dict.fromkeys(targets, str(error))
    found: dict[str, dict[str, NodeBytes]] = defaultdict(dict)
    for node, answer in answers.items():
        for dep in requests[node]:
            found[dep][node] = (
                NodeBytes(None, unknown=answer) if isinstance(answer, str) else answer[dep]
            )
    return found


def deployment_row(
    status: DeploymentStatus,
    history: History,
    sentinel: Sentinel,
    usage: Mapping[str, NodeBytes],
    now: datetime,
) -> dict[str, str]:
    """The deployment's cells, COLUMNS in order."""
    missing = NodeBytes(None, unknown="not measured")
    return {
        "deployment": f"{status.deployment_id} ({status.recipe})",
        "nodes": ", ".join(status.nodes),
        "health": status.health_text,
        "healthy since": history.healthy_since_text(status.healthy, status.started, now),
        "last probe": sentinel.probe_text(status.deployment_id, now),
        "last fault": history.fault_text(now),
        "repairs this hour": history.repairs_text(now),
        "last smoke test": history.last_smoke,
        "bytes on each node": ", ".join(
            usage.get(node, missing).text(node) for node in status.nodes
        ),
    }


def not_ours_row(status: DeploymentStatus) -> dict[str, str]:
    """A container labelled as ours whose labels are not of our form: nothing read about it."""
    return {
        **dict.fromkeys(COLUMNS, NOT_OURS),
        "deployment": f"{status.deployment_id} ({status.recipe})",
        "nodes": ", ".join(status.nodes),
        "health": status.health_text,
    }


@dataclass(frozen=True)
class StatusReport:
    cluster: str
    statuses: list[DeploymentStatus]
    rows: list[dict[str, str]]  # one per deployment, COLUMNS in order

    def lines(self) -> list[str]:
        """One log line per deployment."""
        return ["; ".join(f"{key}: {value}" for key, value in row.items()) for row in self.rows]

    def text(self, width: int) -> str:
        """The CLI's table, `width` characters wide where its columns can wrap to fit."""
        if not self.rows:
            return f"nothing of ours runs on cluster {self.cluster}"
        return "\n".join(text_table(COLUMNS, [list(row.values()) for row in self.rows], width))

    def markdown(self) -> str:
        """The artifact: the deployments' table (its wide cells wrap), then their containers."""
        if not self.rows:
            return f"Nothing of ours runs on cluster {self.cluster}."
        containers = [
            [
                status.deployment_id,
                c.node,
                str(c.rank),
                c.name,
                c.status if c.status == "running" else f"{c.status} ({c.exit_code})",
                c.started_at,
            ]
            for status in self.statuses
            for c in status.containers
        ]
        return "\n".join(
            [
                *markdown_table(COLUMNS, [list(row.values()) for row in self.rows]),
                "",
                "Containers:",
                "",
                *markdown_table(
                    ("deployment", "node", "rank", "container", "state", "started"), containers
                ),
            ]
        )


def read_status(cluster: Cluster, client: SyncPrefectClient, now: datetime) -> StatusReport:
    """What runs on the cluster and what Prefect remembers of it: the nodes' bytes measured
    while the Prefect server is read."""
    statuses = cluster_status(cluster)
    ours = [status for status in statuses if status.ours]
    if not ours:
        return StatusReport(cluster.name, statuses, [not_ours_row(s) for s in statuses])
    ids = [status.deployment_id for status in ours]
    with ThreadPoolExecutor(max_workers=1) as pool:
        measured = pool.submit(measure_nodes, cluster, ours)
        history = read_history(
            client,
            ids,
            now,
            repair_tags={dep: [REPAIR_TAG, deployment_tag(dep)] for dep in ids},
            repair_window=WINDOW,
        )
        sentinel = read_sentinel(client, cluster.name, now)
        usage = measured.result()
    rows = [
        deployment_row(s, history[s.deployment_id], sentinel, usage.get(s.deployment_id, {}), now)
        if s.ours
        else not_ours_row(s)
        for s in statuses
    ]
    return StatusReport(cluster.name, statuses, rows)
