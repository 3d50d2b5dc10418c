"""A built image put on every node: built once on one node from the build context sent to
`docker build -`, then pushed through the cluster registry and pulled on the others, or without a
registry streamed through the flow host (`docker save | docker load`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from sparkdeploy.errors import ImageError
from sparkdeploy.remote.docker_cli import Log, checked, docker, registry_error
from sparkdeploy.remote.runner import Runner
from sparkdeploy.remote.ssh import SshTarget, cached_connection
from sparkdeploy.steps.image.nodes import (
    PULL_TIMEOUT_S,
    ImageFacts,
    NodeAction,
    image_facts,
    on_some,
    pull_on_node,
    with_heartbeat,
)
from sparkdeploy.steps.image.source import CONTEXT_LABEL, BuildContext
from sparkdeploy.units import GIB

BUILD_TIMEOUT_S = 7200.0
LOAD_TIMEOUT_S = 3600.0
# save/load goes through the flow host's memory; larger images need the registry.
MAX_STREAMED_BYTES = 8 * GIB


def registry_reference(registry: str, image: str) -> str:
    """Where `image` lives in the cluster registry: REGISTRY/<name without its own registry>."""
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        image = rest
    return f"{registry}/{image}"


def build(
    node: str,
    target: SshTarget,
    image: str,
    image_dir: Path,
    context: BuildContext,
    log: Log,
) -> None:
    log(
        f"node {node}: building {image} from {image_dir} ({len(context.tar) / 1e6:.1f} MB"
        f" context, digest {context.digest[:12]})"
    )
    argv = ["build", "--label", f"{CONTEXT_LABEL}={context.digest}", "--tag", image, "-"]
    runner = cached_connection(target)
    result = with_heartbeat(
        log,
        f"node {node}: building {image}",
        lambda: docker(runner, argv, timeout=BUILD_TIMEOUT_S, stdin=context.tar),
    )
    if result.exit_code != 0:
        output = (result.stdout + result.stderr).decode("utf-8", "replace").strip()
        raise ImageError(
            f"node {node}: `docker build` of {image} from {image_dir} exited {result.exit_code}:"
            f" {output[-2000:]}; fix the Dockerfile (a failing base image pull is named above)"
        )


def through_registry(
    targets: Mapping[str, SshTarget],
    builder: str,
    behind: list[str],
    image: str,
    registry: str,
    log: Log,
) -> dict[str, tuple[ImageFacts, NodeAction]]:
    reference = registry_reference(registry, image)
    runner = cached_connection(targets[builder])
    checked(
        builder,
        docker(runner, ["tag", image, reference]),
        f"tagging {image} as {reference}",
        "check docker on the node",
    )
    log(f"node {builder}: pushing {reference}")
    pushed = with_heartbeat(
        log,
        f"node {builder}: pushing {reference}",
        lambda: docker(runner, ["push", reference], timeout=PULL_TIMEOUT_S),
    )
    if pushed.exit_code != 0:
        raise registry_error(builder, reference, "pushing", pushed)

    def pull_and_tag(node_runner: Runner, node: str) -> tuple[ImageFacts, NodeAction]:
        began = time.monotonic()
        layers = pull_on_node(node_runner, node, reference, log)
        checked(
            node,
            docker(node_runner, ["tag", reference, image]),
            f"tagging {reference} as {image}",
            "check docker on the node",
        )
        done = NodeAction("distributed", layers, round(time.monotonic() - began, 3))
        return image_facts(node_runner, node, image), done

    return on_some(targets, behind, pull_and_tag)


def streamed(
    targets: Mapping[str, SshTarget],
    builder: str,
    behind: list[str],
    image: str,
    size: int,
    log: Log,
) -> dict[str, tuple[ImageFacts, NodeAction]]:
    if size > MAX_STREAMED_BYTES:
        raise ImageError(
            f"{image} is {size / GIB:.1f} GiB, too large to stream through the flow host"
            f" (limit {MAX_STREAMED_BYTES / GIB:.0f} GiB); set [docker] registry in the cluster"
            " inventory so the nodes pull it from there"
        )
    log(f"node {builder}: saving {image} ({size / 1e6:.1f} MB) for {', '.join(behind)}")
    saved = checked(
        builder,
        docker(cached_connection(targets[builder]), ["save", image], timeout=LOAD_TIMEOUT_S),
        f"saving {image}",
        "check docker and the disk on the node",
    )

    def load(runner: Runner, node: str) -> tuple[ImageFacts, NodeAction]:
        began = time.monotonic()
        checked(
            node,
            docker(runner, ["load"], timeout=LOAD_TIMEOUT_S, stdin=saved.stdout),
            f"loading {image}",
            "check docker and the disk on the node",
        )
        log(f"node {node}: loaded {image}")
        loaded = image_facts(runner, node, image)
        return loaded, NodeAction("distributed", loaded.layers, round(time.monotonic() - began, 3))

    return on_some(targets, behind, load)
