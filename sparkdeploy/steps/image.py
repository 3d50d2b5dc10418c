"""The engine image on every node: pulled, or built once and distributed; then one image ID.

`ensure_image(targets, image)` pulls a prebuilt image on every node that lacks it, in parallel.
`ensure_image(targets, image, image_dir=DIR, registry=REG)` builds DIR once (sent as a tar build
context to the first node's `docker build -`), labels the image with the context's digest, and
puts it on the other nodes through the cluster registry (push from the builder, pull + tag
elsewhere) or, without a registry, a streamed `docker save | docker load`. Either way every node
then holds the same image ID, or ImageError names the odd nodes: mismatched images boot and hang.

A re-run finds the image (with the same context digest, for a built one) everywhere and moves
nothing. Free space under docker's root dir is checked first on every node.

An image built elsewhere (by hand on the nodes, say) from a docker_image_dir this checkout does
not have (`BuiltElsewhere`) is used as the nodes hold it, labelled by us or not, with a warning
that it cannot be rebuilt here; it is never pulled or built. Unless every node holds it with one
image ID, the recipe is refused: the deploy asks the nodes (`check_built_elsewhere`) before its
prefetch, and the image step again.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import stat
import tarfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from sparkdeploy.errors import ImageError, TransientRemoteError
from sparkdeploy.remote.docker_cli import (
    Log,
    Runner,
    checked,
    docker,
    on_nodes,
    probe,
    registry_error,
    stderr_text,
)
from sparkdeploy.remote.ssh import CommandResult, SshTarget, cached_connection
from sparkdeploy.spec.project import find_image_dir, image_dir_fix, image_dir_path
from sparkdeploy.units import GIB

CONTEXT_LABEL = "sparkdeploy.context-sha256"
PULL_TIMEOUT_S = 3600.0
BUILD_TIMEOUT_S = 7200.0
LOAD_TIMEOUT_S = 3600.0
HEARTBEAT_S = 15.0
# Room beyond the image itself (layers are stored unpacked next to the pull's temporary files).
FREE_MARGIN_BYTES = 2 * GIB
# Needed free when no node holds the image yet, so its size is unknown.
DEFAULT_MIN_FREE_BYTES = 20 * GIB
# save/load goes through the flow host's memory; larger images need the registry.
MAX_STREAMED_BYTES = 8 * GIB

_LOG = logging.getLogger(__name__)
T = TypeVar("T")

Action = Literal["present", "pulled", "built", "distributed"]


@dataclass(frozen=True)
class NodeImage:
    node: str
    image_id: str
    action: Action
    layers_moved: int  # layers pulled or loaded onto the node (0 where present or built)
    seconds: float


@dataclass(frozen=True)
class ImageReport:
    image: str
    image_id: str
    nodes: tuple[NodeImage, ...]
    seconds: float

    @property
    def layers_moved(self) -> int:
        return sum(node.layers_moved for node in self.nodes)


@dataclass(frozen=True)
class _Facts:
    image_id: str | None
    size: int
    layers: int
    context: str | None
    root: str
    free_bytes: int
    mirrors: tuple[str, ...]


@dataclass(frozen=True)
class BuildContext:
    tar: bytes
    digest: str  # of paths, modes and contents (not mtimes): equal dirs, equal digest


@dataclass(frozen=True)
class BuiltElsewhere:
    """A recipe whose docker_image_dir is not in this checkout: its image cannot be built here."""

    recipe: str
    docker_image_dir: str
    missing: Path  # where its build context would be: images/<docker_image_dir>


def image_source(
    recipe: str, docker_image_dir: str | None, root: Path | None = None
) -> tuple[Path | None, BuiltElsewhere | None]:
    """The build context of a recipe's image, or that it was built elsewhere; neither for an
    image that is pulled (no docker_image_dir)."""
    if docker_image_dir is None:
        return None, None
    found = find_image_dir(docker_image_dir, root)
    if found is not None:
        return found, None
    return None, BuiltElsewhere(recipe, docker_image_dir, image_dir_path(docker_image_dir, root))


def built_elsewhere_refusal(
    image: str, image_ids: Mapping[str, str | None], source: BuiltElsewhere
) -> str | None:
    """None when every node holds `image` with one image ID (it is then used as it is);
    else why the recipe cannot be deployed: the nodes that lack the image or differ, the fix."""
    held = {image_id for image_id in image_ids.values() if image_id}
    missing = [node for node, image_id in image_ids.items() if image_id is None]
    if not missing and len(held) == 1:
        return None
    problems = [f"missing on {', '.join(missing)}"] if missing else []
    if len(held) > 1:
        problems.append(
            "different images on "
            + ", ".join(
                f"{node} ({image_id[:19]})" for node, image_id in image_ids.items() if image_id
            )
        )
    return (
        f"recipe {source.recipe}: {image} cannot be built here, since its docker_image_dir"
        f" {source.docker_image_dir!r} names {source.missing}, which this checkout does not have;"
        f" and it is not on every node with one image ID: {'; '.join(problems)}. Fix: "
        + image_dir_fix(source.docker_image_dir, image)
        + f", or put {image} on every node by hand (the same image ID everywhere)"
    )


def build_context(image_dir: Path) -> BuildContext:
    """The directory as a tar build context; ImageError when it is no Docker build context."""
    if not (image_dir / "Dockerfile").is_file():
        raise ImageError(
            f"{image_dir}: no Dockerfile in the recipe's docker_image_dir; put the Dockerfile at"
            " the top of that directory"
        )
    digest = hashlib.sha256()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for path in sorted(image_dir.rglob("*")):
            relative = path.relative_to(image_dir).as_posix()
            mode = path.lstat().st_mode
            info = tar.gettarinfo(str(path), arcname=relative)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            digest.update(f"{relative}\0{stat.S_IMODE(mode):o}\0{stat.S_IFMT(mode):o}\0".encode())
            if path.is_symlink():
                digest.update(os.readlink(path).encode())
                tar.addfile(info)
            elif path.is_file():
                content = path.read_bytes()
                digest.update(hashlib.sha256(content).digest())
                tar.addfile(info, io.BytesIO(content))
            else:
                tar.addfile(info)
    return BuildContext(buffer.getvalue(), digest.hexdigest())


def registry_reference(registry: str, image: str) -> str:
    """Where `image` lives in the cluster registry: REGISTRY/<name without its own registry>."""
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        image = rest
    return f"{registry}/{image}"


def _facts(runner: Runner, node: str, image: str) -> _Facts:
    answer = probe(runner, node, "image", {"image": image})
    docker_facts = answer["docker"]
    if "error" in docker_facts:
        raise ImageError(
            f"node {node}: docker does not answer: {docker_facts['error']}; start dockerd there"
        )
    found: dict[str, Any] | None = answer["image"]
    return _Facts(
        image_id=found["id"] if found else None,
        size=found["size"] if found else 0,
        layers=found["layers"] if found else 0,
        context=found["labels"].get(CONTEXT_LABEL) if found else None,
        root=docker_facts["root"],
        free_bytes=docker_facts["free_bytes"],
        mirrors=tuple(docker_facts.get("mirrors", ())),
    )


def _check_free_space(
    facts: Mapping[str, _Facts], nodes: list[str], needed: int, image: str
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


def _with_heartbeat(log: Log, what: str, work: Callable[[], Any]) -> Any:
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


def _pull(
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

    result = _with_heartbeat(log, f"node {node}: pulling {reference}", pull)
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


def _on_some(
    targets: Mapping[str, SshTarget], nodes: list[str], work: Callable[[Runner, str], T]
) -> dict[str, T]:
    return on_nodes({node: targets[node] for node in nodes}, work)


def same_image_id(image: str, image_ids: Mapping[str, str | None], reference_node: str) -> str:
    """The one image ID every node holds; ImageError naming the nodes that differ or lack it."""
    expected = image_ids[reference_node]
    missing = [node for node, image_id in image_ids.items() if image_id is None]
    odd = [
        f"{node} has {image_id}"
        for node, image_id in image_ids.items()
        if image_id not in (None, expected)
    ]
    if missing or odd or expected is None:
        problems = [f"missing on {', '.join(missing)}"] if missing else []
        raise ImageError(
            f"{image} differs between nodes: {reference_node} has {expected}; "
            + "; ".join(problems + odd)
            + ". Mismatched images boot and then hang: re-tag or remove the odd image there"
            " and run the image step again"
        )
    return expected


def ensure_image(
    targets: Mapping[str, SshTarget],
    image: str,
    *,
    image_dir: Path | None = None,
    built_elsewhere: BuiltElsewhere | None = None,
    registry: str | None = None,
    min_free_bytes: int = DEFAULT_MIN_FREE_BYTES,
    log: Log = _LOG.info,
    warn: Log = _LOG.warning,
) -> ImageReport:
    """`image` on every node of `targets` (rank order), one image ID everywhere.

    With image_dir it is built from that directory, with built_elsewhere it is used as the nodes
    hold it or refused (see the module docstring), else pulled.
    """
    if not targets:
        raise ImageError(f"no nodes to put {image} on")
    started = time.monotonic()
    nodes = list(targets)
    facts = on_nodes(targets, lambda runner, node: _facts(runner, node, image))
    if built_elsewhere is not None:
        outcome = _use_built_elsewhere(nodes, image, facts, built_elsewhere, warn)
    elif image_dir is None:
        outcome = _ensure_pulled(targets, image, facts, min_free_bytes, log)
    else:
        outcome = _ensure_built(targets, image, image_dir, registry, facts, min_free_bytes, log)
    after, reference_node, actions = outcome
    image_id = same_image_id(image, {n: f.image_id for n, f in after.items()}, reference_node)
    report = ImageReport(
        image=image,
        image_id=image_id,
        nodes=tuple(
            NodeImage(
                node=node,
                image_id=image_id,
                action=actions[node].action,
                layers_moved=actions[node].layers,
                seconds=actions[node].seconds,
            )
            for node in nodes
        ),
        seconds=round(time.monotonic() - started, 3),
    )
    log(
        f"{image} ({image_id[:19]}) on {len(nodes)} nodes in {report.seconds:.1f} s;"
        f" {report.layers_moved} layers moved"
    )
    return report


@dataclass(frozen=True)
class _Done:
    action: Action
    layers: int
    seconds: float


_PRESENT = _Done("present", 0, 0.0)
_Outcome = tuple[dict[str, _Facts], str, dict[str, _Done]]


def _use_built_elsewhere(
    nodes: list[str], image: str, facts: dict[str, _Facts], source: BuiltElsewhere, warn: Log
) -> _Outcome:
    refusal = built_elsewhere_refusal(image, {n: facts[n].image_id for n in nodes}, source)
    if refusal is not None:
        raise ImageError(refusal)
    warn(
        f"{image} ({facts[nodes[0]].image_id}) is used as every node holds it: it cannot be"
        f" rebuilt here, since recipe {source.recipe}'s docker_image_dir names {source.missing},"
        " which this checkout does not have"
    )
    return facts, nodes[0], dict.fromkeys(nodes, _PRESENT)


def check_built_elsewhere(
    targets: Mapping[str, SshTarget],
    image: str,
    source: BuiltElsewhere,
    *,
    warn: Log = _LOG.warning,
) -> None:
    """ImageError (built_elsewhere_refusal's) unless every node holds `image` with one image ID:
    asked before the deploy's prefetch, so such a recipe is refused before hours of download."""
    facts = on_nodes(targets, lambda runner, node: _facts(runner, node, image))
    _use_built_elsewhere(list(targets), image, facts, source, warn)


def _ensure_pulled(
    targets: Mapping[str, SshTarget],
    image: str,
    facts: dict[str, _Facts],
    min_free_bytes: int,
    log: Log,
) -> _Outcome:
    nodes = list(targets)
    held = {fact.image_id for fact in facts.values() if fact.image_id}
    # Where the tag points at different images, pull everywhere: all get the registry's image.
    absent = [node for node in nodes if facts[node].image_id is None]
    to_pull = nodes if len(held) > 1 else absent
    known_size = max((fact.size for fact in facts.values()), default=0)
    needed = known_size + FREE_MARGIN_BYTES if known_size else min_free_bytes
    _check_free_space(facts, absent, needed, image)
    for node in nodes:
        if node not in to_pull:
            log(f"node {node}: {image} present ({facts[node].image_id}), not pulled")

    def pull(runner: Runner, node: str) -> tuple[_Facts, _Done]:
        began = time.monotonic()
        layers = _pull(runner, node, image, log, facts[node].mirrors)
        done = _Done("pulled", layers, round(time.monotonic() - began, 3))
        return _facts(runner, node, image), done

    pulled = _on_some(targets, to_pull, pull)
    after = {node: pulled[node][0] if node in pulled else facts[node] for node in nodes}
    actions = {node: pulled[node][1] if node in pulled else _PRESENT for node in nodes}
    ids = [after[node].image_id for node in nodes]
    majority = max(ids, key=ids.count)
    return after, nodes[ids.index(majority)], actions


def _ensure_built(
    targets: Mapping[str, SshTarget],
    image: str,
    image_dir: Path,
    registry: str | None,
    facts: dict[str, _Facts],
    min_free_bytes: int,
    log: Log,
) -> _Outcome:
    nodes = list(targets)
    context = build_context(image_dir)
    current = [node for node in nodes if facts[node].context == context.digest]
    builder = current[0] if current else nodes[0]
    actions: dict[str, _Done] = {}
    if not current:
        _check_free_space(facts, [builder], min_free_bytes, image)
        began = time.monotonic()
        _build(builder, targets[builder], image, image_dir, context, log)
        facts[builder] = _facts(cached_connection(targets[builder]), builder, image)
        actions[builder] = _Done("built", 0, round(time.monotonic() - began, 3))
    else:
        log(f"node {builder}: {image} already built from {image_dir} ({context.digest[:12]})")
    built = facts[builder]
    behind = [node for node in nodes if facts[node].image_id != built.image_id]
    _check_free_space(facts, behind, built.size + FREE_MARGIN_BYTES, image)
    if behind and registry:
        moved = _through_registry(targets, builder, behind, image, registry, log)
    elif behind:
        moved = _streamed(targets, builder, behind, image, built.size, log)
    else:
        moved = {}
    for node in nodes:
        if node in moved:
            facts[node], actions[node] = moved[node]
        actions.setdefault(node, _PRESENT)
    return facts, builder, actions


def _build(
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
    result = _with_heartbeat(
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


def _through_registry(
    targets: Mapping[str, SshTarget],
    builder: str,
    behind: list[str],
    image: str,
    registry: str,
    log: Log,
) -> dict[str, tuple[_Facts, _Done]]:
    reference = registry_reference(registry, image)
    runner = cached_connection(targets[builder])
    checked(
        builder,
        docker(runner, ["tag", image, reference]),
        f"tagging {image} as {reference}",
        "check docker on the node",
    )
    log(f"node {builder}: pushing {reference}")
    pushed = _with_heartbeat(
        log,
        f"node {builder}: pushing {reference}",
        lambda: docker(runner, ["push", reference], timeout=PULL_TIMEOUT_S),
    )
    if pushed.exit_code != 0:
        raise registry_error(builder, reference, "pushing", pushed)

    def pull_and_tag(node_runner: Runner, node: str) -> tuple[_Facts, _Done]:
        began = time.monotonic()
        layers = _pull(node_runner, node, reference, log)
        checked(
            node,
            docker(node_runner, ["tag", reference, image]),
            f"tagging {reference} as {image}",
            "check docker on the node",
        )
        done = _Done("distributed", layers, round(time.monotonic() - began, 3))
        return _facts(node_runner, node, image), done

    return _on_some(targets, behind, pull_and_tag)


def _streamed(
    targets: Mapping[str, SshTarget],
    builder: str,
    behind: list[str],
    image: str,
    size: int,
    log: Log,
) -> dict[str, tuple[_Facts, _Done]]:
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

    def load(runner: Runner, node: str) -> tuple[_Facts, _Done]:
        began = time.monotonic()
        checked(
            node,
            docker(runner, ["load"], timeout=LOAD_TIMEOUT_S, stdin=saved.stdout),
            f"loading {image}",
            "check docker and the disk on the node",
        )
        log(f"node {node}: loaded {image}")
        loaded = _facts(runner, node, image)
        return loaded, _Done("distributed", loaded.layers, round(time.monotonic() - began, 3))

    return _on_some(targets, behind, load)
