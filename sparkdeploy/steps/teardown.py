"""Take a deployment down: exactly its containers (by label), their logs kept on the NAS.

Each container's whole log (stdout and stderr merged in time order, with docker's timestamps)
goes to `<runs_dir>/<deployment id>/<node>.log` as the flow host sees the NAS, before the
container is removed; an earlier log of that node moves aside to `<node>.<n>.log`. A container
without our labels is never listed, so never touched; one whose labels do not have our form
(sparkdeploy.model.labels: anyone can label a container) is reported and left alone, so a label
never becomes a path. Running it again finds nothing: a no-op.
The node locks are released by the caller (tasks/teardown.py) once the containers are gone.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sparkdeploy.errors import TeardownError
from sparkdeploy.model.labels import DEPLOYMENT_LABEL, deployment_id_problem, label_problems
from sparkdeploy.remote.docker_cli import (
    ContainerInfo,
    Log,
    Runner,
    container_log,
    list_containers,
    on_nodes,
    remove_containers,
)
from sparkdeploy.remote.ssh import SshTarget

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
