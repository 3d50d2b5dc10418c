"""One node's part of the image step: what it holds (the image, docker's free space, its
registry mirrors), a pull with docker's layer lines logged, and what was done there."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from sparkdeploy.errors import ImageError, TransientRemoteError
from sparkdeploy.remote.docker_cli import Log, on_nodes, registry_error
from sparkdeploy.remote.node_probe import probe
from sparkdeploy.remote.runner import CommandResult, Runner, stderr_text
from sparkdeploy.remote.ssh import SshTarget
from sparkdeploy.steps.image.source import CONTEXT_LABEL
from sparkdeploy.units import GIB

PULL_TIMEOUT_S = 3600.0
HEARTBEAT_S = 15.0
# Room beyond the image itself (layers are stored unpacked next to the pull's temporary files).
FREE_MARGIN_BYTES = 2 * GIB
# Needed free when no node holds the image yet, so its size is unknown.
DEFAULT_MIN_FREE_BYTES = 20 * GIB

T = TypeVar("T")

Action = Literal["present", "pulled", "built", "distributed"]


@dataclass(frozen=True)
class ImageFacts:
    """What a node's probe says of the image (its ID, size, layers, our context label) and of
    its docker (root dir, free bytes there, registry mirrors)."""

    image_id: str | None
    size: int
    layers: int
    context: str | None
    root: str
    free_bytes: int
    mirrors: tuple[str, ...]


@dataclass(frozen=True)
class NodeAction:
    """What the step did on one node: the action, the layers it moved there, its seconds."""

    action: Action
    layers: int
    seconds: float


PRESENT = NodeAction("present", 0, 0.0)


def image_facts(runner: Runner, node: str, image: str) -> ImageFacts:
    answer = probe(runner, node, "image", {"image": image})
    docker_facts = answer["docker"]
    if "error" in docker_facts:
        raise ImageError(
            f"node {node}: docker does not answer: {docker_facts['error']}; start dockerd there"
        )
    found: dict[str, Any] | None = answer["image"]
    return ImageFacts(
        image_id=found["id"] if found else None,
        size=found["size"] if found else 0,
        layers=found["layers"] if found else 0,
        context=found["labels"].get(CONTEXT_LABEL) if found else None,
        root=docker_facts["root"],
        free_bytes=docker_facts["free_bytes"],
        mirrors=tuple(docker_facts.get("mirrors", ())),
    )


def check_free_space(
    facts: Mapping[str, ImageFacts], nodes: list[str], needed: int, image: str
) -> None:
    short = [node for node in nodes if facts[node].free_bytes < needed]
    if short:
        detail = ", ".join(
            f"{node} has {facts[node].free_bytes / GIB:.1f} GiB free under {facts[node].root}"
            for node in short
        )
        raise ImageError(
            f"not enough disk for {image}: {needed / GIB:.1f} GiB needed per node; {detail};"
            " remove unused images (`docker image prune -a`) or grow the disk"
        )


def with_heartbeat(log: Log, what: str, work: Callable[[], Any]) -> Any:
    """work(), logging `what` every HEARTBEAT_S while it runs (docker pull prints no progress
    without a terminal, and a silent 20 GB pull looks hung)."""
    done = threading.Event()
    started = time.monotonic()

    def beat() -> None:
        while not done.wait(HEARTBEAT_S):
            log(f"{what}: still running after {time.monotonic() - started:.0f} s")

    heartbeat = threading.Thread(target=beat, daemon=True)
    heartbeat.start()
    try:
        return work()
    finally:
        done.set()
        heartbeat.join()


def pull_on_node(
    runner: Runner, node: str, reference: str, log: Log, mirrors: tuple[str, ...] = ()
) -> int:
    """Pull on one node, logging docker's layer lines as they come; returns layers downloaded.

    docker pulls through the node's registry mirrors and, when one does not answer, falls back
    to the upstream registry (docs/field.md#nodes-and-fabric): a down mirror then looks like a
    missing image or an unreachable upstream. So when the pull fails so, the mirrors are asked
    from the node, and a mirror that does not answer is the transient cause, retried."""
    log(f"node {node}: pulling {reference}")

    def pull() -> CommandResult:
        stream = runner.stream_lines(["docker", "pull", reference], timeout=PULL_TIMEOUT_S)
        lines = []
        for raw in stream:
            line = raw.decode("utf-8", "replace")
            lines.append(line)
            log(f"node {node}: {line}")
        if stream.ended != "exited":
            raise TransientRemoteError(
                f"node {node}: `docker pull {reference}` did not finish within"
                f" {PULL_TIMEOUT_S:.0f} s ({stream.ended})"
            )
        output = "\n".join(lines).encode()
        return CommandResult(stream.argv, stream.exit_code or 0, output, output)

    result = with_heartbeat(log, f"node {node}: pulling {reference}", pull)
    if result.exit_code != 0:
        error = registry_error(node, reference, "pulling", result)
        if mirrors and not isinstance(error, TransientRemoteError):
            down = {
                url: why
                for url, why in probe(runner, node, "reach", {"urls": mirrors}).items()
                if why
            }
            if down:
                raise TransientRemoteError(
                    f"node {node}: pulling {reference} failed: {stderr_text(result)}; the"
                    f" registry mirror {', '.join(f'{url} ({why})' for url, why in down.items())}"
                    f" does not answer from {node}, so docker fell back to the upstream"
                    " registry: the mirror is down, retrying"
                ) from error
        raise error
    lines = result.stdout.decode().splitlines()
    layers = sum(1 for line in lines if line.endswith(": Pull complete"))
    reused = sum(1 for line in lines if line.endswith(": Already exists"))
    log(f"node {node}: {reference}: {layers} layers downloaded, {reused} already present")
    return layers


def on_some(
    targets: Mapping[str, SshTarget], nodes: list[str], work: Callable[[Runner, str], T]
) -> dict[str, T]:
    return on_nodes({node: targets[node] for node in nodes}, work)
