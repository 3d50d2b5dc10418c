"""The image in a preview: what the image step (sparkdeploy.steps.image.ensure_image) would do
on each node, from what each node's look found: nothing, a pull, a build, a shipment or a
refusal."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.image.distribute import MAX_STREAMED_BYTES
from sparkdeploy.steps.image.nodes import DEFAULT_MIN_FREE_BYTES, FREE_MARGIN_BYTES
from sparkdeploy.steps.image.source import (
    CONTEXT_LABEL,
    build_context,
    built_elsewhere_refusal,
    image_source,
)
from sparkdeploy.steps.preview.model import Rates, Row, timed
from sparkdeploy.steps.preview.nodes import NodeLook
from sparkdeploy.units import human_bytes


def image_rows(plan: Plan, looks: Mapping[str, NodeLook], rates: Rates) -> list[Row]:
    """What the image step would do on each node (sparkdeploy.steps.image.ensure_image)."""
    image = plan.docker_image
    nodes = [node.node for node in plan.nodes]
    broken = {node: look.error for node, look in looks.items() if look.error is not None}
    if broken:
        return [
            Row("image", node, image, "unknown", None, broken[node])
            if node in broken
            else Row("image", node, image, "unknown", None, "another node did not answer")
            for node in nodes
        ]
    ids = {node: _image_id(looks[node]) for node in nodes}
    image_dir, elsewhere = image_source(plan.recipe, plan.docker_image_dir)
    if elsewhere is not None:
        refusal = built_elsewhere_refusal(image, ids, elsewhere)
        if refusal is not None:
            return [Row("image", node, image, "refuse", None, refusal) for node in nodes]
        return [
            Row("image", node, image, "none", 0, f"present ({ids[node]}), built elsewhere: used")
            for node in nodes
        ]
    if image_dir is None:
        return _pull_rows(plan, looks, ids, rates)
    return _build_rows(plan, looks, ids, image_dir, rates)


def _image_id(found: NodeLook) -> str | None:
    return str(found.image["id"]) if found.image else None


def _size(found: NodeLook) -> int:
    return int(found.image["size"]) if found.image else 0


def _pull_rows(
    plan: Plan, looks: Mapping[str, NodeLook], ids: Mapping[str, str | None], rates: Rates
) -> list[Row]:
    image = plan.docker_image
    held = {image_id for image_id in ids.values() if image_id}
    absent = [node for node, image_id in ids.items() if image_id is None]
    # As the image step pulls: where the tag points at different images, every node pulls.
    to_pull = list(ids) if len(held) > 1 else absent
    size = max((_size(found) for found in looks.values()), default=0)
    needed = size + FREE_MARGIN_BYTES if size else DEFAULT_MIN_FREE_BYTES
    different = "the tag names different images on the nodes: " if len(held) > 1 else ""
    rows = []
    for node, image_id in ids.items():
        free = int(looks[node].docker.get("free_bytes", 0))
        if node not in to_pull:
            rows.append(Row("image", node, image, "none", 0, f"present ({image_id})"))
        elif node in absent and free < needed:
            why = f"not enough disk: {human_bytes(needed)} needed, {human_bytes(free)} free"
            rows.append(Row("image", node, image, "refuse", None, why))
        elif size:
            why = (
                f"{different}pull ({human_bytes(size)} as"
                " another node holds it; layers it shares are not pulled)"
            )
            rows.append(timed(Row("image", node, image, "pull", size, why), size, rates.pull))
        else:
            why = f"{different}pull (size unknown until pulled)"
            rows.append(Row("image", node, image, "pull", None, why))
    return rows


def _build_rows(
    plan: Plan,
    looks: Mapping[str, NodeLook],
    ids: Mapping[str, str | None],
    image_dir: Path,
    rates: Rates,
) -> list[Row]:
    image = plan.docker_image
    context = build_context(image_dir)
    labelled = {
        node: (found.image or {}).get("labels", {}).get(CONTEXT_LABEL)
        for node, found in looks.items()
    }
    current = [node for node in ids if labelled[node] == context.digest]
    builder = current[0] if current else next(iter(ids))
    where = (
        f"images/{plan.docker_image_dir} (context {human_bytes(len(context.tar))},"
        f" digest {context.digest[:12]})"
    )
    rows = []
    size = _size(looks[builder]) if current else 0
    for node, image_id in ids.items():
        if node == builder and not current:
            rows.append(Row("image", node, image, "build", None, f"build from {where}"))
        elif node == builder or (current and image_id == ids[builder]):
            rows.append(
                Row("image", node, image, "none", 0, f"present ({image_id}), built from {where}")
            )
        else:
            how = (
                f"through the registry {plan.registry}"
                if plan.registry
                else "by docker save | docker load through the flow host"
            )
            if not plan.registry and size > MAX_STREAMED_BYTES:
                why = (
                    f"{human_bytes(size)} is too large to stream through the flow host: set"
                    " [docker] registry in the inventory"
                )
                rows.append(Row("image", node, image, "refuse", size, why))
                continue
            detail = f"ship from {builder} {how}" + ("" if size else " (size known once built)")
            row = Row("image", node, image, "ship", size or None, detail)
            rows.append(timed(row, size, rates.pull) if size else row)
    return rows
