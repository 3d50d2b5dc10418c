"""What one Engram shard's sparse copy must hold, as checked ON the node before anything is
copied (standard library + shipped modules; part of the sparkdeploy.node.engram_copy script).

A Request is one shard of the node's request; plan_copy checks it against the NAS (the source
shard, its safetensors header, the model's Engram geometry) and gives the CopyPlan: the header
and this node's ranks' row ranges, and the key a manifest must match for a verified copy to be
reused. Beside DEST: DEST.manifest.json (written once a copy is verified or adopted, found by
find_reusable) and the journal of an interrupted copy (where it resumes, resume_point).
check_space asks for room for every copy still to make before the first one starts.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sparkdeploy.errors import EngramError, StagingError
from sparkdeploy.node.engram import (
    HEADER_LENGTH_BYTES,
    EngramGeometry,
    engram_tables,
    merge_ranges,
    rank_byte_ranges,
    read_safetensors_header,
    weight_tensor_name,
)
from sparkdeploy.node.hfcache import SnapshotNotFound, resolve_snapshot
from sparkdeploy.node.staged_file import (
    MANIFEST_SUFFIX,
    PARTIAL_SUFFIX,
    read_json,
    still_describes,
    write_json,
)

FORMAT_VERSION = 1
MIB = 1024 * 1024
DEFAULT_CHUNK_BYTES = 16 * MIB
# Written bytes between two fdatasyncs (each a journal entry); they stay dirty in the page cache
# until then. Measured on one disk with the source: one batch of writes per sync beats starting
# each chunk's writeback as it is written (reads and writes interleave less). Syncing rarely
# would keep more dirty pages and lose more work to an interruption.
DEFAULT_SYNC_BYTES = 128 * MIB
JOURNAL_SUFFIX = ".partial.journal.json"

# Bytes of a copy (or compare) done so far, and in all.
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Request:
    """One shard to stage: the plan's EngramStage (sparkdeploy.spec.plan) as it arrives here,
    with what the node's request says for all its shards."""

    node: str
    nas_hf_cache: str
    repo: str
    revision: str | None
    filename: str
    dest: str
    ranks: tuple[int, ...]
    tp_size: int
    # This deployment's composed dir (None: none): its hard links to DEST are relinked by the
    # compose-model step, so they do not make DEST shared with other lanes.
    composed_root: str | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    sync_bytes: int = DEFAULT_SYNC_BYTES
    # Fault injection for tests: fail as if killed after writing this many chunks in this run.
    stop_after_chunks: int | None = None

    @classmethod
    def from_json(cls, node: dict[str, Any], stage: dict[str, Any]) -> Request:
        """One stage of a node request: {"node", "nas_hf_cache", "composed_root", "chunk_bytes",
        "sync_bytes", "stop_after_chunks", "stages": [EngramStage as JSON, ...]}."""
        return cls(
            node=node["node"],
            nas_hf_cache=node["nas_hf_cache"],
            repo=stage["repo"]["repo"],
            revision=stage["repo"].get("revision"),
            filename=stage["filename"],
            dest=stage["dest"],
            ranks=tuple(sorted(stage["ranks"])),
            tp_size=stage["tp_size"],
            composed_root=node.get("composed_root"),
            chunk_bytes=node.get("chunk_bytes", DEFAULT_CHUNK_BYTES),
            sync_bytes=node.get("sync_bytes", DEFAULT_SYNC_BYTES),
            stop_after_chunks=node.get("stop_after_chunks"),
        )


@dataclass(frozen=True)
class CopyPlan:
    """What DEST must hold: `key` is everything a manifest must match for a copy to be reused."""

    request: Request
    source: str
    size: int
    header_bytes: int
    ranges: list[tuple[int, int]]
    rows: list[dict[str, Any]]
    key: dict[str, Any]
    # Each other rank's row ranges at the same TP size, to name the rank a foreign DEST holds.
    other_rank_ranges: dict[int, list[tuple[int, int]]]

    @property
    def copy_bytes(self) -> int:
        return sum(end - begin for begin, end in self.ranges)


def plan_copy(request: Request) -> CopyPlan:
    """Resolve the source shard and compute the ranges; every check that needs no copying."""
    try:
        commit, snapshot = resolve_snapshot(request.nas_hf_cache, request.repo, request.revision)
    except SnapshotNotFound as exc:
        raise StagingError(str(exc), kind="missing_source") from None
    entry = os.path.join(snapshot, request.filename)
    source = os.path.realpath(entry)
    if not os.path.isfile(source):
        raise StagingError(
            f"source shard {entry} is missing from {request.repo}@{commit} in the NAS HF cache "
            "(or its blob is gone); check the recipe's local_files name, or run the prefetch "
            "step for this repo",
            kind="missing_source",
        )
    stat = os.stat(source)
    try:
        header_len, tensors, _metadata = read_safetensors_header(source)
    except EngramError as exc:
        raise StagingError(f"source shard {entry}: {exc}", kind="bad_header") from None
    finally:
        _drop_cached(source)
    geometry = _read_geometry(os.path.join(snapshot, "config.json"), entry)
    try:
        tables = engram_tables(tensors, geometry)
        if not tables:
            expected = ", ".join(weight_tensor_name(layer) for layer in geometry.layer_ids)
            raise EngramError(
                f"none of the Engram tables ({expected}) is in this shard; the recipe's local "
                'file is not an Engram shard of this model: set kind = "plain" on it to put it '
                "whole on the node"
            )
        engram_ranges = rank_byte_ranges(tensors, geometry, request.ranks, request.tp_size)
        rows = [
            {
                "layer_id": geometry.layer_ids[layer_pos],
                "rank": rank,
                "rows": list(geometry.rank_rows(layer_pos, rank, request.tp_size)),
            }
            for layer_pos, _weight, _scale in tables
            for rank in request.ranks
        ]
        other_rank_ranges = {
            rank: rank_byte_ranges(tensors, geometry, [rank], request.tp_size)
            for rank in range(request.tp_size)
            if rank not in request.ranks
        }
    except EngramError as exc:
        raise StagingError(f"source shard {entry}: {exc}", kind="geometry") from None
    ranges = merge_ranges([(0, HEADER_LENGTH_BYTES + header_len), *engram_ranges])
    identity = {
        "repo": request.repo,
        "revision": request.revision,
        "commit": commit,
        "filename": request.filename,
        "path": source,
        "blob": os.path.basename(source),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }
    key = {
        "format_version": FORMAT_VERSION,
        "source": identity,
        "ranks": list(request.ranks),
        "tp_size": request.tp_size,
        "ranges": [[begin, end] for begin, end in ranges],
    }
    return CopyPlan(
        request=request,
        source=source,
        size=stat.st_size,
        header_bytes=HEADER_LENGTH_BYTES + header_len,
        ranges=ranges,
        rows=rows,
        key=key,
        other_rank_ranges=other_rank_ranges,
    )


def _read_geometry(config_path: str, entry: str) -> EngramGeometry:
    try:
        with open(config_path, encoding="utf-8") as config_file:
            config = json.load(config_file)
    except FileNotFoundError:
        raise StagingError(
            f"{config_path} is missing beside {entry}; run the prefetch step for this repo",
            kind="missing_source",
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StagingError(
            f"{config_path} is not JSON ({exc}); run the prefetch step again", kind="bad_header"
        ) from None
    try:
        geometry = EngramGeometry.from_config(config)
    except EngramError as exc:
        raise StagingError(f"{config_path}: {exc}", kind="geometry") from None
    if geometry is None:
        raise StagingError(
            f"{config_path} has no engram_* keys, so {entry} cannot be an Engram shard of this "
            'model; set kind = "plain" on the recipe\'s local file to put it whole on the node, '
            "or fix the repo",
            kind="geometry",
        )
    return geometry


def find_reusable(plan: CopyPlan) -> dict[str, Any] | None:
    """The manifest of a verified copy that matches the plan, trusting DEST's size and mtime."""
    dest = plan.request.dest
    manifest = read_json(dest + MANIFEST_SUFFIX)
    if manifest is None or {name: manifest.get(name) for name in plan.key} != plan.key:
        return None
    return manifest if still_describes(manifest, dest) else None


def write_manifest(
    plan: CopyPlan,
    stat: os.stat_result,
    range_sums: list[str],
    holes_checked: bool,
    *,
    note: str | None,
) -> dict[str, Any]:
    """DEST.manifest.json for a verified DEST of this stat (copied or adopted)."""
    dest = plan.request.dest
    manifest = {
        **plan.key,
        "range_sha256": range_sums,
        "header_bytes": plan.header_bytes,
        "rows": plan.rows,
        "holes_checked": holes_checked,
        "note": note,
        "dest": {"path": dest, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns},
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_json(dest + MANIFEST_SUFFIX, manifest)
    return manifest


def resume_point(plan: CopyPlan) -> int:
    """Bytes of the copy already durable in DEST.partial (0: start afresh)."""
    dest = plan.request.dest
    journal = read_json(dest + JOURNAL_SUFFIX)
    if journal is None or journal.get("key") != plan.key:
        return 0
    try:
        if os.stat(dest + PARTIAL_SUFFIX).st_size != plan.size:
            return 0
    except FileNotFoundError:
        return 0
    return int(journal["copied_through"])


def check_space(pending: Sequence[tuple[CopyPlan, int]]) -> None:
    """Room for every copy still to make (plan, bytes already durable), per filesystem."""
    needed_by_fs: dict[int, tuple[str, int, list[str]]] = {}
    for plan, resume_from in pending:
        probe = os.path.dirname(plan.request.dest)
        while not os.path.isdir(probe):
            probe = os.path.dirname(probe)
        fs = os.statvfs(probe)
        # Each range may straddle one extra block at either end.
        needed = plan.copy_bytes - resume_from + 2 * len(plan.ranges) * fs.f_frsize
        device = os.stat(probe).st_dev
        _, total, files = needed_by_fs.get(device, (probe, 0, []))
        files.append(f"{plan.request.filename} (ranks {list(plan.request.ranks)})")
        needed_by_fs[device] = (probe, total + needed, files)
    for probe, needed, files in needed_by_fs.values():
        fs = os.statvfs(probe)
        free = fs.f_bavail * fs.f_frsize
        if needed > free:
            raise StagingError(
                f"{probe} has {free / 1e9:.2f} GB free but the sparse copy of "
                f"{' and '.join(files)} there needs {needed / 1e9:.2f} GB more; free space "
                "there or move the recipe's [[composed_model.local_files]] host path to a bigger"
                " disk (on the filesystem of the inventory's composed_root)",
                kind="no_space",
            )


def _drop_cached(path: str) -> None:
    """Drop a file's clean pages, e.g. the readahead (megabytes) a header read pulled in."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
