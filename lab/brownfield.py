"""A lab in the state the old launcher leaves a cluster in: what a first deploy there must adopt.

`make_brownfield(lab, recipe)` puts, for a recipe with Engram local files (the DSV4.1 shape):
- the NAS HF cache of the recipe's repos filled by huggingface_hub's own `snapshot_download`
  from the lab hub, as `hf download` leaves it: no manifest of ours;
- on every node, per-rank sparse copies of the Engram shards at the recipe's local paths,
  written here with ftruncate and pwrite (the header and the rank's rows at their offsets, holes
  elsewhere, as the old launcher's `dd seek=` did), with no manifest of ours, and a second
  "lane" hardlinking each of them from `<lane dir>/<file>`;
- the recipe's image on every node under a `:local` tag that no registry has, with one image ID
  everywhere and no label of ours (the lab's stand-in, pulled from the lab registry and tagged);
- a container that is not ours (no sparkdeploy label) running on the second node.

Files are written from the host through each node's /proc/<sshd>/root (Lab.node_path), docker
is driven through each node's own dockerd socket. The recipe's docker_image must be the tag
given here (recipes/lab-dsv41-brownfield uses BROWNFIELD_IMAGE).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import docker
from huggingface_hub import snapshot_download

from lab.cluster import Lab
from sparkdeploy.node.engram import (
    HEADER_LENGTH_BYTES,
    EngramGeometry,
    merge_ranges,
    rank_byte_ranges,
    read_safetensors_header,
)
from sparkdeploy.node.hfcache import repo_dir, resolve_snapshot
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import load_plan

BROWNFIELD_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "lab-dsv41-brownfield"
BROWNFIELD_IMAGE = "lab-brownfield/vllm-standin:local"
LANE_DIR = "/var/tmp/engram-local/other-lane"
FOREIGN_CONTAINER = "other-lane-sidecar"
# The lab registry's stand-in the hand-made image is tagged from (lab.image pushes it).
STANDIN_REPOSITORY = "lab/vllm-standin"


@dataclass(frozen=True)
class HandMadeCopy:
    node: str
    dest: str  # as the node sees it
    lane_link: str  # the other lane's hardlink to it, as the node sees it
    ranks: tuple[int, ...]
    inode: int
    materialised_bytes: int


@dataclass(frozen=True)
class Brownfield:
    copies: list[HandMadeCopy]
    image_id: str
    foreign_container: str  # its node is the plan's second node
    foreign_node: str
    nas_repos: list[str]


def make_brownfield(lab: Lab, recipe: str, *, cluster: str | None = None) -> Brownfield:
    """Put the lab (its inventory: `cluster`, default the lab's own) in the state the old
    launcher leaves for `recipe`, replacing whatever a deploy of ours left there."""
    cluster_path = cluster or str(lab.inventory_path)
    inventory = load_cluster(Path(cluster_path))
    plan = load_plan(recipe, cluster_path)
    nas = inventory.nas.hf_cache
    for ref in plan.repos:
        shutil.rmtree(repo_dir(nas, ref.repo), ignore_errors=True)
        snapshot_download(
            ref.repo, revision=ref.revision, cache_dir=nas, endpoint=lab.hub_url, token=False
        )
    copies = [
        _hand_made_copy(
            lab,
            node.node,
            stage.repo.repo,
            stage.repo.revision,
            stage.filename,
            stage.dest,
            stage.ranks,
            stage.tp_size,
            nas,
        )
        for node in plan.nodes
        for stage in node.engram
    ]
    image_id = _tag_everywhere(lab, [node.node for node in plan.nodes])
    foreign_node = plan.nodes[1].node if len(plan.nodes) > 1 else plan.nodes[0].node
    _start_foreign_container(lab, foreign_node)
    return Brownfield(
        copies, image_id, FOREIGN_CONTAINER, foreign_node, [r.repo for r in plan.repos]
    )


def _hand_made_copy(
    lab: Lab,
    node: str,
    repo: str,
    revision: str | None,
    filename: str,
    dest: str,
    ranks: list[int],
    tp_size: int,
    nas: str,
) -> HandMadeCopy:
    _, snapshot = resolve_snapshot(nas, repo, revision)
    source = os.path.realpath(os.path.join(snapshot, filename))
    header_len, tensors, _ = read_safetensors_header(source)
    with open(os.path.join(snapshot, "config.json"), encoding="utf-8") as config_file:
        geometry = EngramGeometry.from_config(json.load(config_file))
    if geometry is None:
        raise ValueError(f"{repo} has no Engram geometry in its config.json")
    ranges = merge_ranges(
        [
            (0, HEADER_LENGTH_BYTES + header_len),
            *rank_byte_ranges(tensors, geometry, ranks, tp_size),
        ]
    )
    target = lab.node_path(node, dest)
    for leftover in target.parent.glob(f"{target.name}*"):
        leftover.unlink()  # a copy of ours, its manifest, a partial: the old launcher made none
    target.parent.mkdir(parents=True, exist_ok=True)
    size = os.path.getsize(source)
    with open(source, "rb") as src, open(target, "wb") as out:
        out.truncate(size)
        for begin, end in ranges:
            src.seek(begin)
            os.pwrite(out.fileno(), src.read(end - begin), begin)
        os.fsync(out.fileno())
    lane = f"{LANE_DIR}/{Path(dest).parent.name}/{filename}"
    lane_target = lab.node_path(node, str(Path(lane).parent)) / filename
    lane_target.parent.mkdir(parents=True, exist_ok=True)
    lane_target.unlink(missing_ok=True)
    os.link(target, lane_target)
    return HandMadeCopy(
        node=node,
        dest=dest,
        lane_link=lane,
        ranks=tuple(ranks),
        inode=target.stat().st_ino,
        materialised_bytes=sum(end - begin for begin, end in ranges),
    )


def _node_docker(lab: Lab, node: str) -> docker.DockerClient:
    return docker.DockerClient(base_url=f"unix://{lab.docker_socket(node)}", timeout=300)


def _tag_everywhere(lab: Lab, nodes: list[str]) -> str:
    """The stand-in pulled from the lab registry on each node and tagged BROWNFIELD_IMAGE: one
    image ID everywhere (the registry's config digest), no label of ours."""
    ids: set[str] = set()
    repository, tag = BROWNFIELD_IMAGE.rsplit(":", 1)
    for node in nodes:
        engine = _node_docker(lab, node)
        try:
            # Through the node's registry mirror, as a recipe's image is.
            image = engine.images.pull(STANDIN_REPOSITORY, tag="latest")
            image.tag(repository, tag)
            ids.add(image.id)
        finally:
            engine.close()
    if len(ids) != 1:
        raise RuntimeError(f"the stand-in has {len(ids)} image IDs on the lab's nodes: {ids}")
    return ids.pop()


def _start_foreign_container(lab: Lab, node: str) -> None:
    """Another team's container: no label of ours, left alone by every step."""
    engine = _node_docker(lab, node)
    try:
        for old in engine.containers.list(all=True, filters={"name": FOREIGN_CONTAINER}):
            old.remove(force=True)
        engine.containers.run(
            BROWNFIELD_IMAGE,
            entrypoint=["sleep", "infinity"],
            name=FOREIGN_CONTAINER,
            detach=True,
            network_mode="none",
        )
    finally:
        engine.close()


def clear_brownfield(lab: Lab, field: Brownfield) -> None:
    """What make_brownfield left that later tests would trip on: the container that is not ours,
    and the :local tag on every node (it keeps the stand-in's layers, so a later pull of the
    stand-in would find them all there). The Engram copies and the NAS cache stay: a deploy's
    teardown and the NAS are the tests' own business."""
    nodes = sorted({copy.node for copy in field.copies} | {field.foreign_node})
    for node in nodes:
        engine = _node_docker(lab, node)
        try:
            if node == field.foreign_node:
                for old in engine.containers.list(all=True, filters={"name": FOREIGN_CONTAINER}):
                    old.remove(force=True)
            if engine.images.list(name=BROWNFIELD_IMAGE):
                engine.images.remove(BROWNFIELD_IMAGE)
        finally:
            engine.close()
