"""The node side of a preview: who holds each node, its image, its Engram copies, its composed
dir and its containers, each read as the deploy's step would read it, and nothing written.

Every node script runs read-only (node_script.build_node_script(write_code_cache=False)): it
writes not even its code cache. The docker CLI is asked only `ps` and `inspect`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import httpx
from prefect.exceptions import PrefectHTTPStatusError

from sparkdeploy.errors import SparkDeployError, StagingError
from sparkdeploy.node import engram
from sparkdeploy.node import hfcache as node_hfcache
from sparkdeploy.node import stage_engram as node_staging
from sparkdeploy.remote.docker_cli import (
    ContainerInfo,
    Runner,
    deployments_present,
    list_containers,
    on_nodes,
    probe,
)
from sparkdeploy.remote.node_script import (
    STDERR_TAIL_CHARS,
    PythonRunner,
    build_node_script,
    last_json_line,
)
from sparkdeploy.remote.ssh import SshTarget
from sparkdeploy.spec.labels import DEPLOYMENT_LABEL, label_problems
from sparkdeploy.spec.plan import EngramStage, NodePlan, Plan
from sparkdeploy.steps.hold_nodes import NodeHolder, ended_runs, holder_decision, holders
from sparkdeploy.steps.image import (
    CONTEXT_LABEL,
    DEFAULT_MIN_FREE_BYTES,
    FREE_MARGIN_BYTES,
    MAX_STREAMED_BYTES,
    build_context,
    built_elsewhere_refusal,
    image_source,
)
from sparkdeploy.steps.preview.model import Action, Rates, Row, timed
from sparkdeploy.steps.stage_engram import node_request
from sparkdeploy.units import human_bytes

T = TypeVar("T")
# The node script's words for a shard (stage_engram.preview_all) as a preview's actions.
_SHARD_ACTIONS: dict[str, Action] = {
    "skip": "none",
    "adopt": "adopt",
    "copy": "copy",
    "resume": "resume",
    "refuse": "refuse",
}
# The dry run reads headers, configs and a few samples: as long as staging's own silence bound.
ENGRAM_DRY_RUN_TIMEOUT_S = 120.0


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


def hold_rows(
    plan: Plan, targets: Mapping[str, SshTarget], *, replace: bool, lock_timeout_s: float
) -> tuple[list[Row], dict[str, NodeHolder | None]]:
    """Who holds each node and what the deploy's hold-nodes would do about it; the holders
    (for the boot rows). Asked of the Prefect server, without taking or writing anything."""
    nodes = [node.node for node in plan.nodes]
    try:
        held = holders(plan.cluster, nodes)
        ended = ended_runs({holder.flow_run_id for holder in held.values() if holder})
    except (httpx.HTTPError, PrefectHTTPStatusError, OSError) as error:
        why = f"the Prefect server did not answer ({error}): who holds the node is unknown"
        return [Row("hold-nodes", node, "node lock", "unknown", None, why) for node in nodes], {}
    to_ask = {
        node: [holder.deployment_id]
        for node, holder in held.items()
        if holder is not None
        and holder.deployment_id != plan.deployment_id
        and holder.flow_run_id in ended
    }
    left = deployments_present(targets, to_ask) if to_ask else {}
    rows = []
    for node in nodes:
        holder = held[node]
        if holder is None:
            rows.append(Row("hold-nodes", node, "node lock", "take", None, "free"))
            continue
        run_ended = holder.flow_run_id in ended
        run = f"flow run {holder.flow_run_id}, {'ended' if run_ended else 'running'}"
        decision = holder_decision(
            holder,
            plan.deployment_id,
            None,
            run_ended=run_ended,
            containers_left=left.get(node, False),
            replacing=replace and holder.deployment_id != plan.deployment_id,
        )
        if holder.deployment_id == plan.deployment_id:
            if decision == "take over":
                rows.append(
                    Row(
                        "hold-nodes",
                        node,
                        "node lock",
                        "take over",
                        None,
                        f"held by this deployment ({run}): redeploy, its hold taken over",
                    )
                )
            else:
                rows.append(
                    Row(
                        "hold-nodes",
                        node,
                        "node lock",
                        "wait",
                        None,
                        f"held by another run of this deployment ({run}): wait for it, up to"
                        f" {lock_timeout_s:.0f} s",
                    )
                )
            continue
        as_named = holder.taken_as(plan.cluster, node)
        who = f"held by deployment {holder.deployment_id}{as_named} ({run})"
        if decision == "take over" and replace:
            rows.append(Row("hold-nodes", node, "node lock", "replace", None, f"{who}: replace"))
        elif decision == "take over":
            rows.append(
                Row(
                    "hold-nodes",
                    node,
                    "node lock",
                    "take over",
                    None,
                    f"{who}, nothing of it left on {node}: take over",
                )
            )
        else:
            why = (
                "its flow run is still going"
                if not run_ended
                else f"its containers are still on {node}"
                if left.get(node)
                else f"whether its containers are still on {node} is unknown"
            )
            rows.append(
                Row(
                    "hold-nodes",
                    node,
                    "node lock",
                    "wait",
                    None,
                    f"{who}: wait up to {lock_timeout_s:.0f} s ({why}), then fail; tear it down or"
                    " deploy with replace=true",
                )
            )
    return rows, held


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
    # As _ensure_pulled: where the tag points at different images, every node pulls.
    to_pull = list(ids) if len(held) > 1 else absent
    size = max((_size(found) for found in looks.values()), default=0)
    needed = size + FREE_MARGIN_BYTES if size else DEFAULT_MIN_FREE_BYTES
    rows = []
    for node, image_id in ids.items():
        free = int(looks[node].docker.get("free_bytes", 0))
        if node not in to_pull:
            rows.append(Row("image", node, image, "none", 0, f"present ({image_id})"))
        elif node in absent and free < needed:
            rows.append(
                Row(
                    "image",
                    node,
                    image,
                    "refuse",
                    None,
                    f"not enough disk: {human_bytes(needed)} needed, {human_bytes(free)} free",
                )
            )
        else:
            why = "the tag names different images on the nodes: " if len(held) > 1 else ""
            if size:
                row = Row(
                    "image",
                    node,
                    image,
                    "pull",
                    size,
                    f"{why}pull ({human_bytes(size)} as"
                    " another node holds it; layers it shares are not pulled)",
                )
                rows.append(timed(row, size, rates.pull))
            else:
                rows.append(
                    Row(
                        "image", node, image, "pull", None, f"{why}pull (size unknown until pulled)"
                    )
                )
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
                rows.append(
                    Row(
                        "image",
                        node,
                        image,
                        "refuse",
                        size,
                        f"{human_bytes(size)} is too large to stream through the flow host: set"
                        " [docker] registry in the inventory",
                    )
                )
                continue
            detail = f"ship from {builder} {how}" + ("" if size else " (size known once built)")
            row = Row("image", node, image, "ship", size or None, detail)
            rows.append(timed(row, size, rates.pull) if size else row)
    return rows


@cache
def _engram_script() -> str:
    return build_node_script(node_staging, [engram, node_hfcache], write_code_cache=False)


def engram_dry_run(
    runner: PythonRunner,
    node: str,
    *,
    nas_hf_cache: str,
    stages: Sequence[EngramStage],
    composed_root: str | None,
) -> list[dict[str, Any]]:
    """The staging script's dry run on one node: per shard {"dest", "action", "bytes", "why"}
    (sparkdeploy.node.stage_engram.preview_all), from the request the step itself sends
    (sparkdeploy.steps.stage_engram.node_request)."""
    request = node_request(
        node, nas_hf_cache=nas_hf_cache, stages=stages, composed_root=composed_root
    )
    completed = runner.run_python(
        _engram_script(),
        [json.dumps({**request, "dry_run": True})],
        timeout=ENGRAM_DRY_RUN_TIMEOUT_S,
        check=False,
    )
    answer = last_json_line(completed.stdout)
    if answer is None or not answer.get("ok"):
        why = (
            f"[{answer.get('kind')}] {answer.get('message')}"
            if answer
            else completed.stderr.decode("utf-8", "replace")[-STDERR_TAIL_CHARS:]
        )
        raise StagingError(f"node {node}: the staging dry run failed: {why}")
    shards = []
    for line in completed.stdout.decode("utf-8", "replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            found = json.loads(line)
            if isinstance(found, dict) and "preview" in found:
                shards.append(found["preview"])
    return shards


def engram_rows(plan: Plan, targets: Mapping[str, SshTarget], rates: Rates) -> list[Row]:
    """What stage-engram would do with each shard of each node (engram_dry_run)."""
    staged = {node.node: node for node in plan.nodes if node.engram}

    def dry_run(runner: Runner, name: str) -> list[dict[str, Any]]:
        node = staged[name]
        return engram_dry_run(
            runner,
            name,
            nas_hf_cache=plan.nas_hf_cache,
            stages=node.engram,
            composed_root=node.composed.root if node.composed else None,
        )

    rows = []
    for name, found in per_node({n: targets[n] for n in staged}, dry_run).items():
        if isinstance(found, str):
            rows += [
                Row("stage-engram", name, stage.dest, "unknown", None, found)
                for stage in staged[name].engram
            ]
            continue
        for shard in found:
            action = _SHARD_ACTIONS[shard["action"]]
            row = Row("stage-engram", name, shard["dest"], action, shard["bytes"], shard["why"])
            moving = action in ("copy", "resume", "adopt")
            rows.append(timed(row, shard["bytes"], rates.nas_to_disk(name)) if moving else row)
    return rows


def compose_rows(plan: Plan, engram: Sequence[Row]) -> list[Row]:
    """compose-model has no dry run: it keeps a composed dir whose key (the sources' snapshots,
    the local files' inode, size and mtime) still matches, else rebuilds it, links only."""
    rows = []
    for node in plan.nodes:
        if node.composed is None:
            continue
        renewed = [
            row.subject
            for row in engram
            if row.node == node.node and row.action in ("copy", "resume")
        ]
        detail = (
            f"rebuilt: the Engram copies {', '.join(renewed)} are new files"
            if renewed
            else "kept if its key still matches, else (re)built"
        )
        rows.append(
            Row(
                "compose-model",
                node.node,
                node.composed.root,
                "compose",
                0,
                f"{detail} (symlinks to the NAS and hardlinks: no data is copied)",
            )
        )
    return rows


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
        for container in found.ours:
            rows.append(_container_row(plan, node, container, holder, replace=replace))
        for other in found.foreign:
            rows.append(
                Row(
                    "boot",
                    node.node,
                    other["name"],
                    "none",
                    None,
                    f"not ours ({other['image']}): left alone",
                )
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
