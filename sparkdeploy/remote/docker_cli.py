"""The docker CLI on a node, over SSH: argv lists through sparkdeploy.remote.ssh, JSON answers
parsed.

Also turns docker's error text into the project's errors: a registry that is down or slow is
transient (TransientRemoteError, retried by the task); an unknown image, refused credentials, a
full disk or an unreachable network are not (ImageError, with the fix).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sparkdeploy.errors import ImageError, RemoteError, TransientRemoteError
from sparkdeploy.remote.runner import CommandResult, Runner, stderr_text
from sparkdeploy.remote.ssh import SshTarget, on_all
from sparkdeploy.spec.labels import DEPLOYMENT_LABEL

DOCKER_TIMEOUT_S = 60.0
# What dockerd answers `docker rm` of a container another removal is already removing.
_REMOVAL_UNDER_WAY = "is already in progress"
REMOVAL_POLL_S = 0.2

T = TypeVar("T")
Log = Callable[[str], None]

_TRANSIENT = re.compile(
    r"connection refused|connection reset|i/o timeout|tls handshake timeout|"
    r"context deadline exceeded|client\.timeout|unexpected eof|\b50[234]\b|bad gateway|"
    r"service unavailable|gateway timeout|too many requests|toomanyrequests|no route to host",
    re.IGNORECASE,
)
_UNKNOWN = re.compile(
    r"manifest unknown|not found|repository does not exist|name unknown|"
    r"pull access denied|invalid reference format",
    re.IGNORECASE,
)
_AUTH = re.compile(r"unauthorized|authentication required|denied|no basic auth", re.IGNORECASE)
_NO_SPACE = re.compile(r"no space left on device", re.IGNORECASE)
_UNREACHABLE = re.compile(
    r"network is unreachable|no such host|server misbehaving|temporary failure in name resolution",
    re.IGNORECASE,
)
_DAEMON_DOWN = re.compile(
    r"cannot connect to the docker daemon|is the docker daemon running", re.IGNORECASE
)
# A failed pull or push by its stderr, the first match deciding: the error it is and what to do
# ({node}: the node's name).
_REGISTRY_FAILURES: tuple[tuple[re.Pattern[str], type[Exception], str], ...] = (
    (_DAEMON_DOWN, RemoteError, "docker is not running on {node}: start dockerd there"),
    (_NO_SPACE, ImageError, "free disk space under docker's root dir on {node}"),
    (
        _UNREACHABLE,
        ImageError,
        "the registry cannot be reached from {node} (no route or no DNS). If the nodes use a"
        " registry mirror, the mirror does not hold this image and docker fell back to the"
        " upstream registry: push the image to the mirror or fix the name",
    ),
    (_TRANSIENT, TransientRemoteError, "the registry is down or overloaded, retrying"),
    (
        _UNKNOWN,
        ImageError,
        "the image does not exist in its registry: check the recipe's docker_image (name and tag)",
    ),
    (
        _AUTH,
        ImageError,
        "the registry refused the credentials: run `docker login REGISTRY` on {node} as the SSH"
        " user",
    ),
)


@dataclass(frozen=True)
class ContainerInfo:
    id: str
    name: str
    image: str
    labels: dict[str, str]
    status: str  # created, running, exited, ...
    exit_code: int
    started_at: str
    image_id: str = ""  # the image it was created from (sha256:...), whatever its tag says now


def on_nodes(targets: Mapping[str, SshTarget], work: Callable[[Runner, str], T]) -> dict[str, T]:
    """work(connection, node name) on every node at once (sparkdeploy.remote.ssh.on_all)."""
    names = {target: name for name, target in targets.items()}
    return on_all(targets, lambda connection: work(connection, names[connection.target]))


def docker(
    runner: Runner,
    args: Sequence[str],
    *,
    timeout: float = DOCKER_TIMEOUT_S,
    stdin: bytes | None = None,
) -> CommandResult:
    """`docker ARGS` on the node, the result returned whatever the exit code."""
    return runner.run(["docker", *args], timeout=timeout, stdin=stdin, check=False)


def checked(node: str, result: CommandResult, what: str, fix: str) -> CommandResult:
    """result itself when it exited 0; else the error its stderr says it is."""
    if result.exit_code == 0:
        return result
    stderr = stderr_text(result)
    message = f"node {node}: {what} failed (`{' '.join(result.argv)}` exited {result.exit_code})"
    if _DAEMON_DOWN.search(stderr):
        raise RemoteError(
            f"{message}: docker is not running there ({stderr}); start dockerd on {node}"
        )
    raise RemoteError(f"{message}: {stderr or '(no stderr)'}; {fix}")


def registry_error(node: str, image: str, action: str, result: CommandResult) -> Exception:
    """The error a failed pull or push of `image` is, judged by docker's stderr."""
    stderr = stderr_text(result)
    where = f"node {node}: {action} {image} failed: {stderr or f'exit {result.exit_code}'}"
    for pattern, error, advice in _REGISTRY_FAILURES:
        if pattern.search(stderr):
            return error(f"{where}; {advice.format(node=node)}")
    return RemoteError(where)


def list_containers(runner: Runner, node: str, label: str) -> list[ContainerInfo]:
    """Every container (running or not) with `label` (KEY or KEY=VALUE) on the node."""
    listed = checked(
        node,
        docker(runner, ["ps", "-a", "-q", "--no-trunc", "--filter", f"label={label}"]),
        f"listing containers labelled {label}",
        "check docker on the node",
    )
    ids = listed.stdout.decode().split()
    if not ids:
        return []
    inspected = docker(runner, ["inspect", *ids])
    if inspected.exit_code != 0:
        # A container removed between ps and inspect: list again, once, without it.
        relisted = docker(runner, ["ps", "-a", "-q", "--no-trunc", "--filter", f"label={label}"])
        ids = relisted.stdout.decode().split()
        if not ids:
            return []
        inspected = checked(
            node,
            docker(runner, ["inspect", *ids]),
            "inspecting containers",
            "check docker on the node",
        )
    return [_container_info(entry) for entry in json.loads(inspected.stdout or b"[]")]


def _container_info(entry: dict[str, Any]) -> ContainerInfo:
    state = entry.get("State") or {}
    config = entry.get("Config") or {}
    return ContainerInfo(
        id=entry["Id"],
        name=entry.get("Name", "").lstrip("/"),
        image=config.get("Image", ""),
        labels=config.get("Labels") or {},
        status=state.get("Status", "unknown"),
        exit_code=int(state.get("ExitCode", 0)),
        started_at=state.get("StartedAt", ""),
        image_id=entry.get("Image", ""),
    )


def deployments_present(
    targets: Mapping[str, SshTarget], deployments_of: Mapping[str, Collection[str]]
) -> dict[str, bool | None]:
    """Whether each node of deployments_of has a container (running or not) of any of its
    deployment ids, one `docker ps` per node, all nodes at once; None for every node when one
    of them could not be asked (a node down or rebooting proves nothing)."""

    def on_node(runner: Runner, node: str) -> bool:
        listed = checked(
            node,
            docker(
                runner,
                [
                    *("ps", "-a", "--filter", f"label={DEPLOYMENT_LABEL}"),
                    *("--format", f'{{{{.Label "{DEPLOYMENT_LABEL}"}}}}'),
                ],
            ),
            f"listing containers labelled {DEPLOYMENT_LABEL}",
            "check docker on the node",
        )
        return not set(deployments_of[node]).isdisjoint(listed.stdout.decode().split())

    try:
        return dict(on_nodes({node: targets[node] for node in deployments_of}, on_node))
    except RemoteError:
        return dict.fromkeys(deployments_of)


def container_log(runner: Runner, node: str, container_id: str, *, timeout: float) -> str:
    """The container's whole log, stdout and stderr merged in time order, with timestamps."""
    result = checked(
        node,
        docker(runner, ["logs", "--timestamps", container_id], timeout=timeout),
        f"reading the log of container {container_id[:12]}",
        "check docker on the node",
    )
    return merge_timestamped(
        result.stdout.decode("utf-8", "replace"), result.stderr.decode("utf-8", "replace")
    )


def _timestamp_key(line: str) -> str:
    """docker's RFC 3339 timestamps trim trailing zeros; pad the fraction so they sort."""
    stamp = line.split(" ", 1)[0]
    if "." in stamp and stamp.endswith("Z"):
        whole, fraction = stamp[:-1].split(".", 1)
        return f"{whole}.{fraction:0<9}"
    return stamp


def merge_timestamped(stdout: str, stderr: str) -> str:
    lines = stdout.splitlines() + stderr.splitlines()
    lines.sort(key=_timestamp_key)
    return "".join(line + "\n" for line in lines)


def remove_containers(
    runner: Runner, node: str, container_ids: Sequence[str], *, stop_timeout_s: int
) -> None:
    """Stop (SIGTERM, then SIGKILL after stop_timeout_s) and remove the containers."""
    if not container_ids:
        return
    stopped = docker(
        runner,
        ["stop", "--time", str(stop_timeout_s), *container_ids],
        timeout=stop_timeout_s + DOCKER_TIMEOUT_S,
    )
    if stopped.exit_code != 0 and "No such container" not in stderr_text(stopped):
        checked(node, stopped, "stopping containers", "check docker on the node")
    removed = docker(runner, ["rm", "--force", *container_ids])
    error = stderr_text(removed)
    if removed.exit_code != 0 and _REMOVAL_UNDER_WAY in error:
        # Another removal of it is under way (a concurrent teardown, or docker's own): theirs
        # finishes the job, and this one waits for it.
        _wait_until_removed(runner, node, container_ids)
    elif removed.exit_code != 0 and "No such container" not in error:
        checked(node, removed, "removing containers", "check docker on the node")


def _wait_until_removed(runner: Runner, node: str, container_ids: Sequence[str]) -> None:
    deadline = time.monotonic() + DOCKER_TIMEOUT_S
    while True:
        listed = checked(
            node,
            docker(runner, ["ps", "--all", "--quiet", "--no-trunc"]),
            "listing containers",
            "check docker on the node",
        )
        present = listed.stdout.decode().split()
        left = [cid for cid in container_ids if any(p.startswith(cid) for p in present)]
        if not left:
            return
        if time.monotonic() > deadline:
            raise RemoteError(
                f"node {node}: containers {', '.join(left)} were still being removed after"
                f" {DOCKER_TIMEOUT_S:.0f} s; check docker on the node"
            )
        time.sleep(REMOVAL_POLL_S)
