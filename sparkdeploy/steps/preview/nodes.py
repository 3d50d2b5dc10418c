"""The nodes in a preview: each node's docker, image and containers, read at once on every node
(a node that does not answer leaves the others' answers), and what boot would do with the
containers; each read as the deploy's step would read it, and nothing written.

Every node script runs read-only (node_script.build_node_script(write_code_cache=False)): it
writes not even its code cache. The docker CLI is asked only `ps` and `inspect`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from sparkdeploy.errors import SparkDeployError
from sparkdeploy.remote.docker_cli import ContainerInfo, list_containers, on_nodes
from sparkdeploy.remote.node_probe import probe
from sparkdeploy.remote.runner import Runner
from sparkdeploy.remote.ssh import SshTarget
from sparkdeploy.spec.labels import DEPLOYMENT_LABEL, label_problems
from sparkdeploy.spec.plan import NodePlan, Plan
from sparkdeploy.steps.hold_nodes import NodeHolder
from sparkdeploy.steps.preview.model import Row

T = TypeVar("T")


@dataclass(frozen=True)
class NodeLook:
    """One node as the `look` probe and `docker ps`/`inspect` see it (error: it did not answer)."""

    docker: dict[str, Any]
    image: dict[str, Any] | None
    ours: list[ContainerInfo]  # containers labelled sparkdeploy.deployment
    foreign: list[dict[str, str]]  # running containers without it: name, image
    error: str | None = None


def per_node(
    targets: Mapping[str, SshTarget], work: Callable[[Runner, str], T]
) -> dict[str, T | str]:
    """work on every node at once; a node that cannot be reached or asked gives its error's
    text instead, so one node down leaves the others' answers (and says so) rather than ending
    the preview."""

    def on_one(node: str) -> T | str:
        try:
            return on_nodes({node: targets[node]}, work)[node]
        except (SparkDeployError, OSError) as error:
            said = str(error).removeprefix(f"node {node}: ")
            return f"node {node} did not answer: {said}"

    if not targets:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        return dict(zip(targets, pool.map(on_one, targets), strict=True))


def look(targets: Mapping[str, SshTarget], image: str) -> dict[str, NodeLook]:
    """Each node's docker, image and containers, in one probe and one `docker ps` + `inspect`."""

    def on_node(runner: Runner, node: str) -> NodeLook:
        answer = probe(
            runner, node, "look", {"image": image, "stale_label": DEPLOYMENT_LABEL}, read_only=True
        )
        if "error" in answer["docker"]:
            return NodeLook(answer["docker"], None, [], [], error=answer["docker"]["error"])
        ours = list_containers(runner, node, DEPLOYMENT_LABEL)
        return NodeLook(answer["docker"], answer["image"], ours, answer["foreign_containers"])

    return {
        node: found if isinstance(found, NodeLook) else NodeLook({}, None, [], [], error=found)
        for node, found in per_node(targets, on_node).items()
    }


def boot_rows(
    plan: Plan,
    looks: Mapping[str, NodeLook],
    held: Mapping[str, NodeHolder | None],
    *,
    replace: bool,
) -> list[Row]:
    """What boot (and, with replace, the retirement before it) would do with the containers on
    each node (sparkdeploy.steps.boot.stop_stale): ours removed or replaced, others named."""
    rows = []
    for node in plan.nodes:
        found = looks[node.node]
        if found.error is not None:
            rows.append(Row("boot", node.node, "containers", "unknown", None, found.error))
            continue
        holder = held.get(node.node)
        rows.extend(
            _container_row(plan, node, container, holder, replace=replace)
            for container in found.ours
        )
        rows.extend(
            Row(
                "boot",
                node.node,
                other["name"],
                "none",
                None,
                f"not ours ({other['image']}): left alone",
            )
            for other in found.foreign
        )
        if not found.ours and not found.foreign:
            rows.append(Row("boot", node.node, "containers", "none", None, "no container there"))
    return rows


def _container_row(
    plan: Plan,
    node: NodePlan,
    container: ContainerInfo,
    holder: NodeHolder | None,
    *,
    replace: bool,
) -> Row:
    problems = label_problems(container.labels, node.node)
    if problems:
        why = f"labels not of our form ({'; '.join(problems)}): left alone"
        return Row("boot", node.node, container.name, "none", None, why)
    deployment = container.labels[DEPLOYMENT_LABEL]
    state = f"{container.status}, image {container.image_id[:19]}"
    if deployment == plan.deployment_id:
        why = f"remove the stale copy of this deployment ({state}), then start it anew"
        return Row("boot", node.node, container.name, "remove", None, why)
    if holder is not None and holder.deployment_id == deployment:
        if replace:
            why = f"replace deployment {deployment}'s container ({state})"
            return Row("boot", node.node, container.name, "replace", None, why)
        why = f"deployment {deployment} holds the node: its container stays (see hold-nodes)"
        return Row("boot", node.node, container.name, "wait", None, why)
    why = f"remove the stale container of deployment {deployment}, which no longer holds the node"
    return Row("boot", node.node, container.name, "remove", None, why)
