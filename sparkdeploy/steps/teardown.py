"""Take a deployment down: exactly its containers (by label), their logs kept on the NAS.

Each container's whole log (stdout and stderr merged in time order, with docker's timestamps)
goes to `<runs_dir>/<deployment id>/<node>.log` as the flow host sees the NAS, before the
container is removed; an earlier log of that node moves aside to `<node>.<n>.log`. A container
without our labels is never listed, so never touched; one whose labels do not have our form
(sparkdeploy.spec.labels: anyone can label a container) is reported and left alone, so a label
never becomes a path. Running it again finds nothing: a no-op.
The node locks are released by the caller (tasks/teardown.py) once the containers are gone.

A teardown asked for a recipe goes by what is on the nodes and in the node lock records, not by
the recipe file alone: a recipe deleted, broken or changed since its deploy (another
required_nodes plans another deployment id) would otherwise tear down nothing, or fail, while
its deployment runs on. recipe_teardown decides which deployment that is.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sparkdeploy.errors import TeardownError
from sparkdeploy.remote.docker_cli import (
    ContainerInfo,
    Log,
    container_log,
    list_containers,
    on_nodes,
    remove_containers,
)
from sparkdeploy.remote.runner import Runner
from sparkdeploy.remote.ssh import SshTarget
from sparkdeploy.spec.labels import (
    DEPLOYMENT_LABEL,
    RECIPE_LABEL,
    deployment_id_problem,
    deployment_recipe,
    label_problems,
)
from sparkdeploy.spec.plan import SPEC_LABEL

LOG_TIMEOUT_S = 300.0
DEFAULT_STOP_TIMEOUT_S = 20
EXCERPT_LINES = 40

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemovedContainer:
    node: str
    deployment_id: str
    container_id: str
    name: str
    status: str  # before removal: running, exited, ...
    exit_code: int
    log_path: str
    log_bytes: int
    excerpt: list[str]  # the log's last lines


@dataclass(frozen=True)
class TeardownReport:
    deployment_id: str
    removed: list[RemovedContainer]
    seconds: float


def _keep_log(runs_dir: str, deployment_id: str, node: str, text: str) -> Path:
    directory = Path(runs_dir) / deployment_id
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{node}.log"
        if path.exists():
            earlier = 1
            while (directory / f"{node}.{earlier}.log").exists():
                earlier += 1
            path.rename(directory / f"{node}.{earlier}.log")
        partial = directory / f".{node}.log.partial"
        partial.write_text(text)
        os.replace(partial, path)
    except OSError as error:
        raise TeardownError(
            f"cannot save the log of deployment {deployment_id} on node {node} under"
            f" {directory}: {error}; check that the NAS runs_dir is mounted and writable on the"
            " flow host (the containers were left running)"
        ) from error
    return path


def remove_labelled(
    targets: Mapping[str, SshTarget],
    label: str,
    runs_dir: str,
    *,
    stop_timeout_s: int = DEFAULT_STOP_TIMEOUT_S,
    select: Callable[[str, ContainerInfo], bool] = lambda node, container: True,
    log: Log = _LOG.info,
) -> list[RemovedContainer]:
    """On every node at once: containers with `label` (sparkdeploy.deployment[=ID]) that
    `select(node, container)` picks logged, then removed. Those whose labels are not of our form
    are reported and left alone."""

    def on_node(runner: Runner, node: str) -> list[RemovedContainer]:
        removed = []
        containers = []
        for container in list_containers(runner, node, label):
            problems = label_problems(container.labels, node)
            if problems:
                log(
                    f"node {node}: left container {container.name} ({container.id[:12]}) alone:"
                    f" its labels are not ours ({'; '.join(problems)})"
                )
            elif select(node, container):
                containers.append(container)
        for container in containers:
            text = container_log(runner, node, container.id, timeout=LOG_TIMEOUT_S)
            deployment_id = container.labels[DEPLOYMENT_LABEL]
            path = _keep_log(runs_dir, deployment_id, node, text)
            removed.append(
                RemovedContainer(
                    node=node,
                    deployment_id=deployment_id,
                    container_id=container.id,
                    name=container.name,
                    status=container.status,
                    exit_code=container.exit_code,
                    log_path=str(path),
                    log_bytes=len(text.encode()),
                    excerpt=text.splitlines()[-EXCERPT_LINES:],
                )
            )
        remove_containers(runner, node, [c.id for c in containers], stop_timeout_s=stop_timeout_s)
        return removed

    by_node = on_nodes(targets, on_node)
    return [container for node in targets for container in by_node[node]]


def teardown(
    deployment_id: str,
    targets: Mapping[str, SshTarget],
    runs_dir: str,
    *,
    stop_timeout_s: int = DEFAULT_STOP_TIMEOUT_S,
    select: Callable[[str, ContainerInfo], bool] = lambda node, container: True,
    log: Log = _LOG.info,
) -> TeardownReport:
    """The deployment's containers on these nodes (give the whole cluster when unsure) that
    `select(node, container)` picks (default: all) removed, their logs saved first.
    Idempotent."""
    if (problem := deployment_id_problem(deployment_id)) is not None:
        raise TeardownError(
            f"cannot tear down: {problem}; give the id a deploy's summary or the status flow shows"
        )
    started = time.monotonic()
    removed = remove_labelled(
        targets,
        f"{DEPLOYMENT_LABEL}={deployment_id}",
        runs_dir,
        stop_timeout_s=stop_timeout_s,
        select=select,
        log=log,
    )
    for container in removed:
        log(
            f"node {container.node}: removed {container.name} ({container.status}, exit"
            f" {container.exit_code}); {container.log_bytes} bytes of log in {container.log_path}"
        )
    if not removed:
        log(f"deployment {deployment_id}: no containers on {', '.join(targets)}")
    return TeardownReport(
        deployment_id=deployment_id,
        removed=removed,
        seconds=round(time.monotonic() - started, 3),
    )


def left_on_nodes(
    cluster: str,
    nodes: Sequence[str],
    composed_dir: str | None,
    local_files: Sequence[str],
    *,
    known: bool = True,
) -> str:
    """The teardown's line on what it leaves on the nodes (so that a redeploy finds it warm),
    and what frees it. known=False: the recipe could not say whether it composed a dir."""
    if composed_dir is None and not local_files:
        return f"nothing of it is left on {', '.join(nodes)} (no composed model)"
    what = [f"the composed dir {composed_dir}" + ("" if known else " (where it had one)")]
    what += [f"the local files {', '.join(local_files)}"] if local_files else []
    return (
        f"left on {', '.join(nodes)}: {' and '.join(what)}, for a warm redeploy; the prune flow"
        " frees them once older than its min_age_hours and no recipe names the files (its dry"
        f" run lists them first): prefect deployment run 'prune/nightly' -p cluster={cluster}"
        " -p dry_run=false"
    )


@dataclass(frozen=True)
class Found:
    """A deployment of a recipe on a cluster, as its containers and node lock records show it."""

    deployment_id: str
    nodes: tuple[str, ...]  # with a container of it, or held by it; in the cluster's order
    specs: dict[str, str] = field(default_factory=dict)  # node -> its container's spec label


def recipe_containers(
    targets: Mapping[str, SshTarget], recipe_id: str
) -> dict[str, list[ContainerInfo]]:
    """node -> the containers labelled as of recipe `recipe_id` there (labels of our form)."""
    found = on_nodes(
        targets, lambda runner, node: list_containers(runner, node, f"{RECIPE_LABEL}={recipe_id}")
    )
    return {
        node: [c for c in containers if not label_problems(c.labels, node)]
        for node, containers in found.items()
    }


def recipe_deployments(
    recipe_id: str,
    containers: Mapping[str, Sequence[ContainerInfo]],
    held_by: Mapping[str, str | None],
) -> list[Found]:
    """The deployments of recipe `recipe_id` on a cluster: those its containers name (node ->
    containers, recipe_containers) and those holding its nodes (node -> the deployment id its
    lock record names, None: free), the records matched by the recipe part of the id."""
    nodes: dict[str, list[str]] = {}
    specs: dict[str, dict[str, str]] = {}
    for node in [*containers, *(n for n in held_by if n not in containers)]:
        for container in containers.get(node, []):
            deployment_id = container.labels[DEPLOYMENT_LABEL]
            nodes.setdefault(deployment_id, [])
            if node not in nodes[deployment_id]:
                nodes[deployment_id].append(node)
            specs.setdefault(deployment_id, {})[node] = container.labels.get(SPEC_LABEL, "")
        holder = held_by.get(node)
        if holder is not None and deployment_recipe(holder) == recipe_id[:40]:
            nodes.setdefault(holder, [])
            if node not in nodes[holder]:
                nodes[holder].append(node)
    return [
        Found(deployment_id, tuple(on), specs.get(deployment_id, {}))
        for deployment_id, on in sorted(nodes.items())
    ]


@dataclass(frozen=True)
class RecipeTeardown:
    """What a teardown of a recipe takes down, and what to tell the person about it."""

    by_plan: bool  # the plan's deployment, on its nodes (as always); else deployment_ids
    deployment_ids: list[str]  # by id across the cluster (empty with by_plan)
    notes: list[str]


def recipe_teardown(
    recipe: str,
    cluster: str,
    found: Sequence[Found],
    *,
    plan_id: str | None,
    plan_nodes: Sequence[str] = (),
    plan_specs: Mapping[str, str] | None = None,
    unplanned: str | None = None,
    nodes: Sequence[str] | None = None,
) -> RecipeTeardown:
    """Which deployment a teardown of `recipe` takes down, given the deployments of it `found`
    on `cluster` and its plan now (plan_id, its nodes and node -> spec label; None with
    `unplanned` saying why it cannot be planned). With `nodes` given only deployments on them
    count.

    The plan's deployment when it runs, or when nothing of the recipe does. Otherwise what runs
    of the recipe, by deployment id: every deployment found when the recipe cannot be planned
    (all are orphans), the one found when it plans another id (an earlier version of it runs);
    several then are refused, since which one was meant is not known. Never the plan's id
    alone while another deployment of the recipe runs in its place."""
    if nodes:
        found = [f for f in found if set(f.nodes) & set(nodes)]
    on = {f.deployment_id: f for f in found}
    where = "; ".join(f"{f.deployment_id} on {', '.join(f.nodes)}" for f in found)
    if plan_id is not None and (plan_id in on or not found):
        notes = []
        running = on.get(plan_id)
        if running is not None and plan_specs is not None:
            changed = [n for n, spec in running.specs.items() if plan_specs.get(n) != spec]
            if changed:
                notes.append(
                    f"recipe {recipe} changed since {plan_id} was deployed: what runs on"
                    f" {', '.join(changed)} is not what the recipe plans now (torn down all the"
                    " same)"
                )
        others = [f for f in found if f.deployment_id != plan_id]
        if others:
            notes.append(
                f"other deployments of recipe {recipe} on cluster {cluster} are left running: "
                + "; ".join(f"{f.deployment_id} on {', '.join(f.nodes)}" for f in others)
                + " (tear one down with deployment_id=<its id>)"
            )
        return RecipeTeardown(True, [], notes)
    why = (
        f"recipe {recipe} cannot be planned ({unplanned})"
        if plan_id is None
        else f"recipe {recipe} now plans deployment {plan_id} on {', '.join(plan_nodes)}, which"
        " does not run"
    )
    if not found:
        return RecipeTeardown(
            False,
            [],
            [
                f"{why}, and nothing of it runs or holds a node of cluster {cluster}: nothing to"
                " tear down"
            ],
        )
    if plan_id is not None and len(found) > 1:
        raise TeardownError(
            f"{why}; several deployments of it are on cluster {cluster}: {where}. Tear the one"
            " you mean down with deployment_id=<its id> (or name its nodes with nodes=...)"
        )
    return RecipeTeardown(
        False,
        [f.deployment_id for f in found],
        [
            f"{why}: tearing down what runs of it by deployment id, as its containers and node"
            f" locks name it: {where}"
        ],
    )
