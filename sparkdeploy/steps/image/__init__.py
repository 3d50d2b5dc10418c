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

One module per job:
  __init__.py    ensure_image(): pulled, built or used as the nodes hold it; one image ID
  source.py      where the image comes from: its name, a build context here, or built elsewhere
  nodes.py       what a node holds and its free space; a pull on one node
  distribute.py  a built image built on one node and shipped to the others
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sparkdeploy.errors import ImageError
from sparkdeploy.remote.docker_cli import Log, on_nodes
from sparkdeploy.remote.runner import Runner
from sparkdeploy.remote.ssh import SshTarget, cached_connection
from sparkdeploy.steps.image.distribute import build, streamed, through_registry
from sparkdeploy.steps.image.nodes import (
    DEFAULT_MIN_FREE_BYTES,
    FREE_MARGIN_BYTES,
    PRESENT,
    Action,
    ImageFacts,
    NodeAction,
    check_free_space,
    image_facts,
    on_some,
    pull_on_node,
)
from sparkdeploy.steps.image.source import BuiltElsewhere, build_context, built_elsewhere_refusal

_LOG = logging.getLogger(__name__)


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
    facts = on_nodes(targets, lambda runner, node: image_facts(runner, node, image))
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


_Outcome = tuple[dict[str, ImageFacts], str, dict[str, NodeAction]]


def _use_built_elsewhere(
    nodes: list[str], image: str, facts: dict[str, ImageFacts], source: BuiltElsewhere, warn: Log
) -> _Outcome:
    refusal = built_elsewhere_refusal(image, {n: facts[n].image_id for n in nodes}, source)
    if refusal is not None:
        raise ImageError(refusal)
    warn(
        f"{image} ({facts[nodes[0]].image_id}) is used as every node holds it: it cannot be"
        f" rebuilt here, since recipe {source.recipe}'s docker_image_dir names {source.missing},"
        " which this checkout does not have"
    )
    return facts, nodes[0], dict.fromkeys(nodes, PRESENT)


def check_built_elsewhere(
    targets: Mapping[str, SshTarget],
    image: str,
    source: BuiltElsewhere,
    *,
    warn: Log = _LOG.warning,
) -> None:
    """ImageError (built_elsewhere_refusal's) unless every node holds `image` with one image ID:
    asked before the deploy's prefetch, so such a recipe is refused before hours of download."""
    facts = on_nodes(targets, lambda runner, node: image_facts(runner, node, image))
    _use_built_elsewhere(list(targets), image, facts, source, warn)


def _ensure_pulled(
    targets: Mapping[str, SshTarget],
    image: str,
    facts: dict[str, ImageFacts],
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
    check_free_space(facts, absent, needed, image)
    for node in nodes:
        if node not in to_pull:
            log(f"node {node}: {image} present ({facts[node].image_id}), not pulled")

    def pull(runner: Runner, node: str) -> tuple[ImageFacts, NodeAction]:
        began = time.monotonic()
        layers = pull_on_node(runner, node, image, log, facts[node].mirrors)
        done = NodeAction("pulled", layers, round(time.monotonic() - began, 3))
        return image_facts(runner, node, image), done

    pulled = on_some(targets, to_pull, pull)
    after = {node: pulled[node][0] if node in pulled else facts[node] for node in nodes}
    actions = {node: pulled[node][1] if node in pulled else PRESENT for node in nodes}
    ids = [after[node].image_id for node in nodes]
    majority = max(ids, key=ids.count)
    return after, nodes[ids.index(majority)], actions


def _ensure_built(
    targets: Mapping[str, SshTarget],
    image: str,
    image_dir: Path,
    registry: str | None,
    facts: dict[str, ImageFacts],
    min_free_bytes: int,
    log: Log,
) -> _Outcome:
    nodes = list(targets)
    context = build_context(image_dir)
    current = [node for node in nodes if facts[node].context == context.digest]
    builder = current[0] if current else nodes[0]
    actions: dict[str, NodeAction] = {}
    if not current:
        check_free_space(facts, [builder], min_free_bytes, image)
        began = time.monotonic()
        build(builder, targets[builder], image, image_dir, context, log)
        facts[builder] = image_facts(cached_connection(targets[builder]), builder, image)
        actions[builder] = NodeAction("built", 0, round(time.monotonic() - began, 3))
    else:
        log(f"node {builder}: {image} already built from {image_dir} ({context.digest[:12]})")
    built = facts[builder]
    behind = [node for node in nodes if facts[node].image_id != built.image_id]
    check_free_space(facts, behind, built.size + FREE_MARGIN_BYTES, image)
    if behind and registry:
        moved = through_registry(targets, builder, behind, image, registry, log)
    elif behind:
        moved = streamed(targets, builder, behind, image, built.size, log)
    else:
        moved = {}
    for node in nodes:
        if node in moved:
            facts[node], actions[node] = moved[node]
        actions.setdefault(node, PRESENT)
    return facts, builder, actions
