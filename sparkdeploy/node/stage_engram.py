"""The Engram sparse copies of one node, as they run ON the node (standard library + two
shipped modules).

sparkdeploy.steps.stage_engram ships this module with sparkdeploy.node.engram and
sparkdeploy.node.hfcache (see sparkdeploy.remote.node_script) and calls `main([request_json])` once
per node for all its shards. It prints JSON lines on stdout as it goes: {"plan": ...} once every
shard is checked, {"progress": ...} while a copy runs, {"result": ...} per shard, and {"ok": true}
last; a deliberate failure ends with {"ok": false, "kind": ..., "message": ..., "dest": ...} and
exit status FAILED_EXIT. A request with "dry_run": true (a preview) writes nothing: `preview_all`
prints one {"preview": ...} line per shard saying what stage_all would do, then {"ok": true}.

Every shard is checked before anything is copied (source, header, geometry, free space for all
the copies together). The copy: a file of the shard's full size holding the header and this
node's ranks' row ranges at their original offsets, holes elsewhere, written to DEST.partial in
fixed-size chunks by three threads passing a few reused buffers around (memory stays bounded):

- the reader prefetches the next chunk (WILLNEED; readahead would cache bytes past the ranges'
  ends), reads the chunk and drops it from the page cache;
- the writer writes it, reads it back through the file and compares it with the source bytes;
  every sync_bytes it makes the written part durable (fdatasync), then drops it from the page
  cache (DONTNEED drops clean pages only; unified memory: cached copy pages compete with the
  GPU for the same RAM) and records in a journal how far the durable part reaches, so an
  interrupted copy resumes there (a resumed run reads the durable part back from the disk and
  compares it too);
- the hasher computes each range's sha256 for the manifest, off the reader's path.

Then the file's data extents are checked against the ranges (holes where holes belong), and
only then is DEST.partial renamed to DEST and DEST.manifest.json written.

A DEST already there without a manifest matching the plan (a copy made by hand or by the old
launcher, which other lanes may hard-link, or one of ours for another source revision) is
checked against the source while the shards are checked, before anything is written: its size,
its header bytes, then every byte of the ranges, both files read in chunks with readahead (each
chunk dropped from the page cache once read, what readahead brought in past the ranges once the
compare is done) and compared while another thread hashes the source's bytes, the first
difference ending the compare. One that matches is ADOPTED: the manifest a copy would get is
written beside it (with the same range sha256s, computed from the source bytes the compare
read) and the file is not touched (no truncate, no rename, same inode and mtime; a leftover
DEST.partial and its journal are removed).
A full compare costs one read of the share from the NAS, as a copy does, plus one read of it
from the local disk, but no writes, no second copy's space, and the other lanes' links stay on
the file; there is no sampled compare: a sample cannot give the range sha256s the manifest
records, and a copy missing a few rows would pass it. Only the header and the ranges count:
a DEST with data outside them (e.g. fully materialised: no holes at all) is adopted all the
same, as rewriting it sparse would move it off the other lanes' links; its result and manifest
carry a note saying how much it allocates beyond a sparse copy.

A DEST that does not match is replaced by a copy as above, except (both fail before any copy):
- wrong_rank: it is no copy of ours (no manifest describing it) and holds another rank's rows
  (its header and a sample of that rank's rows match the source); the plan's rank order is not
  the one it was made for, which is for the operator to sort out;
- linked_mismatch: other paths hard-link it (st_nlink > 1), so other lanes may use it; a new
  copy would leave them on the old file and cost its space again. Links inside this
  deployment's composed dir do not count (the compose-model step relinks them to the new copy);
  the links found in the composed dirs beside it (the inventory's composed_root) are named.
Adoption only reads DEST and writes the manifest last, in one rename: one that fails part-way
leaves DEST as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import queue
import stat as stat_mode
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from sparkdeploy.node.engram import (
    HEADER_LENGTH_BYTES,
    EngramError,
    EngramGeometry,
    engram_tables,
    merge_ranges,
    rank_byte_ranges,
    read_safetensors_header,
    weight_tensor_name,
)
from sparkdeploy.node.hfcache import SnapshotNotFound, resolve_snapshot

FORMAT_VERSION = 1
MIB = 1024 * 1024
DEFAULT_CHUNK_BYTES = 16 * MIB
# Chunk buffers passed from the reader to the writer to the hasher and back; the writer has one
# more for reading back.
CHUNK_BUFFERS = 5
# Chunk buffer pairs (source, DEST) of an adoption's compare: one is read into while the other is
# compared and hashed.
COMPARE_PAIRS = 2
# Written bytes between two fdatasyncs (each a journal entry); they stay dirty in the page cache
# until then. Measured on one disk with the source: one batch of writes per sync beats starting
# each chunk's writeback as it is written (reads and writes interleave less). Syncing rarely
# would keep more dirty pages and lose more work to an interruption.
DEFAULT_SYNC_BYTES = 128 * MIB
FAILED_EXIT = 3
PROGRESS_INTERVAL_S = 1.0
# Bytes compared at each end of each of another rank's ranges to tell whether DEST holds them
# (only for the wrong_rank message, so a sample: a full compare would read the share again).
RANK_SAMPLE_BYTES = 1 * MIB
QUEUE_POLL_S = 0.2
PARTIAL_SUFFIX = ".partial"
JOURNAL_SUFFIX = ".partial.journal.json"
MANIFEST_SUFFIX = ".manifest.json"

T = TypeVar("T")
Progress = Callable[[int, int], None]
Emit = Callable[[dict[str, Any]], None]


class StagingFailure(Exception):
    """A deliberate failure: `kind` tells the host which case it is, the message the fix."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        # The copy it is about (None: all of them, e.g. free space), for the host's message.
        self.dest: str | None = None


class _Aborted(Exception):
    """Another pipeline thread failed; this one stops quietly."""


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
class StagingResult:
    """One staged shard, as the node reports it (a {"result": ...} line) and the flow reads it."""

    node: str
    status: str  # "copied", "resumed", "adopted" or "skipped"
    dest: str
    source: str
    size: int
    ranks: tuple[int, ...]
    tp_size: int
    header_bytes: int
    share_bytes: int
    copied_bytes: int
    allocated_bytes: int
    ranges: tuple[tuple[int, int], ...]
    range_sha256: tuple[str, ...]
    holes_checked: bool
    seconds: float
    # What an adopted DEST holds beyond a sparse copy (e.g. fully materialised), else None.
    note: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StagingResult:
        """The inverse of dataclasses.asdict, which JSON turned the tuples into lists for."""
        return cls(
            **{
                **data,
                "ranks": tuple(data["ranks"]),
                "ranges": tuple((begin, end) for begin, end in data["ranges"]),
                "range_sha256": tuple(data["range_sha256"]),
            }
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


@dataclass(frozen=True)
class Chunk:
    range_index: int
    offset: int
    length: int
    # Bytes of the whole copy up to the end of this chunk (the journal's unit).
    copied_through: int


def plan_copy(request: Request) -> CopyPlan:
    """Resolve the source shard and compute the ranges; every check that needs no copying."""
    try:
        commit, snapshot = resolve_snapshot(request.nas_hf_cache, request.repo, request.revision)
    except SnapshotNotFound as exc:
        raise StagingFailure("missing_source", str(exc)) from None
    entry = os.path.join(snapshot, request.filename)
    source = os.path.realpath(entry)
    if not os.path.isfile(source):
        raise StagingFailure(
            "missing_source",
            f"source shard {entry} is missing from {request.repo}@{commit} in the NAS HF cache "
            "(or its blob is gone); check the recipe's local_files name, or run the prefetch "
            "step for this repo",
        )
    stat = os.stat(source)
    try:
        header_len, tensors, _metadata = read_safetensors_header(source)
    except EngramError as exc:
        raise StagingFailure("bad_header", f"source shard {entry}: {exc}") from None
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
        raise StagingFailure("geometry", f"source shard {entry}: {exc}") from None
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
        raise StagingFailure(
            "missing_source",
            f"{config_path} is missing beside {entry}; run the prefetch step for this repo",
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StagingFailure(
            "bad_header", f"{config_path} is not JSON ({exc}); run the prefetch step again"
        ) from None
    try:
        geometry = EngramGeometry.from_config(config)
    except EngramError as exc:
        raise StagingFailure("geometry", f"{config_path}: {exc}") from None
    if geometry is None:
        raise StagingFailure(
            "geometry",
            f"{config_path} has no engram_* keys, so {entry} cannot be an Engram shard of this "
            'model; set kind = "plain" on the recipe\'s local file to put it whole on the node, '
            "or fix the repo",
        )
    return geometry


def find_reusable(plan: CopyPlan) -> dict[str, Any] | None:
    """The manifest of a verified copy that matches the plan, trusting DEST's size and mtime."""
    dest = plan.request.dest
    manifest = _read_json(dest + MANIFEST_SUFFIX)
    if manifest is None or {name: manifest.get(name) for name in plan.key} != plan.key:
        return None
    try:
        stat = os.stat(dest)
    except FileNotFoundError:
        return None
    recorded = manifest.get("dest", {})
    if (stat.st_size, stat.st_mtime_ns) != (recorded.get("size"), recorded.get("mtime_ns")):
        return None
    return manifest


def adopt(plan: CopyPlan, progress: Progress) -> dict[str, Any] | None:
    """Adopt an existing DEST that holds what the copy would (see the module docstring).

    Returns the manifest written beside it; None when there is no DEST, or one that the copy may
    replace; raises wrong_rank or linked_mismatch for one it must not replace.
    """
    request = plan.request
    dest = request.dest
    try:
        before = os.stat(dest)
    except FileNotFoundError:
        return None
    with (
        open(plan.source, "rb") as source,
        open(dest, "rb") as existing,
        _read_ahead_then_drop(source.fileno(), existing.fileno()),
    ):
        src_fd, dst_fd = source.fileno(), existing.fileno()
        mismatch: str | None
        range_sums: list[str] = []
        held: int | None = None
        if before.st_size != plan.size:
            mismatch = f"it is {before.st_size} bytes, the source {plan.size}"
        elif os.pread(dst_fd, plan.header_bytes, 0) != os.pread(src_fd, plan.header_bytes, 0):
            mismatch = "its safetensors header differs from the source's"
        else:
            mismatch, range_sums = _compare(plan, src_fd, dst_fd, progress)
        if mismatch is None:
            holes_checked, note = _adopted_extents(dst_fd, plan)
        else:
            held = None if _own_manifest(dest, before) else _held_rank(plan, src_fd, dst_fd)
    if mismatch is None:
        after = os.stat(dest)
        if (after.st_ino, after.st_size, after.st_mtime_ns) != (
            before.st_ino,
            before.st_size,
            before.st_mtime_ns,
        ):
            raise StagingFailure(
                "io",
                f"{dest} changed while it was compared with {plan.source}; another process "
                "writes it: stop it, then run the step again",
            )
        manifest = _write_manifest(plan, after, range_sums, holes_checked, note=note)
        _remove(dest + JOURNAL_SUFFIX)
        _remove(dest + PARTIAL_SUFFIX)
        _fsync_dir(os.path.dirname(dest))
        return manifest
    ranks = ", ".join(map(str, request.ranks))
    wanted = f"rank{'s' if len(request.ranks) > 1 else ''} {ranks} of TP {request.tp_size}"
    links = _links_elsewhere(request, before)
    if held is not None:
        shared = f", {before.st_nlink} hard links" if before.st_nlink > 1 else ""
        raise StagingFailure(
            "wrong_rank",
            f"{dest} holds rank {held}'s rows, this plan gives node {request.node} {wanted}: "
            f"{mismatch}, but its header and a sample of rank {held}'s rows match {plan.source}"
            f"; it is no copy of ours (no manifest{shared}), so it is left alone; the deploy "
            "cannot reorder the ranks: list the nodes in the order the file was made for, or "
            "point the recipe's [[composed_model.local_files]] host path at another path, or, "
            f"once no other lane uses it, remove or rename {dest} by hand",
        )
    if links:
        raise StagingFailure(
            "linked_mismatch",
            f"{dest} does not match {plan.source} for {wanted} ({mismatch}) and has "
            f"{before.st_nlink} hard links (other than itself: {links}): other lanes may use it,"
            " and a new copy would leave them on the old file and take "
            f"{plan.copy_bytes / 1e9:.2f} GB more here; check what the other lanes need, then "
            f"remove or rename {dest} by hand, or point the recipe's "
            "[[composed_model.local_files]] host path at another path",
        )
    return None


def _own_manifest(dest: str, stat: os.stat_result) -> bool:
    """Whether DEST is a copy of ours: a manifest describes this very file (of any plan)."""
    recorded = (_read_json(dest + MANIFEST_SUFFIX) or {}).get("dest", {})
    return (stat.st_size, stat.st_mtime_ns) == (recorded.get("size"), recorded.get("mtime_ns"))


def _links_elsewhere(request: Request, stat: os.stat_result) -> str:
    """The message's account of DEST's other links: "" when there are none, or only in this
    deployment's composed dir (the links in the composed dirs beside it are named)."""
    if stat.st_nlink == 1:
        return ""
    found: list[str] = []
    searched = None
    if request.composed_root is not None:
        searched = os.path.dirname(request.composed_root.rstrip("/"))
        found = _same_inode_under(searched, stat)
    others = [path for path in found if not _is_under(path, request.composed_root)]
    unknown = stat.st_nlink - 1 - len(found)
    parts = []
    if others:
        parts.append(f"{len(others)} in other deployments' composed dirs: {', '.join(others)}")
    if unknown:
        parts.append(f"{unknown} outside {searched}" if searched else f"{unknown} elsewhere")
    return "; ".join(parts)


def _is_under(path: str, root: str | None) -> bool:
    return root is not None and path.startswith(root.rstrip("/") + "/")


def _same_inode_under(top: str, stat: os.stat_result) -> list[str]:
    """The paths under top that are hard links to the file of this stat (symlinks not
    followed; composed dirs are small trees of symlinks and a few links)."""
    found = []
    for directory, _subdirs, files in os.walk(top):
        for name in files:
            path = os.path.join(directory, name)
            try:
                entry = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat_mode.S_ISREG(entry.st_mode) and (entry.st_dev, entry.st_ino) == (
                stat.st_dev,
                stat.st_ino,
            ):
                found.append(path)
    return sorted(found)


@contextlib.contextmanager
def _read_ahead_then_drop(*fds: int) -> Iterator[None]:
    """Sequential readahead on these files while inside; none of their pages cached after.

    Read without readahead (POSIX_FADV_RANDOM), the compare took three times the kernel CPU
    (the page cache filled page by page, not in large folios) and twice the time. Readahead
    brings in bytes past a range's end that no chunk's DONTNEED covers; the whole files are
    dropped at the end for them (as plan_copy drops the source after reading its header).
    """
    for fd in fds:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    try:
        yield
    finally:
        for fd in fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _compare(
    plan: CopyPlan, src_fd: int, dst_fd: int, progress: Progress
) -> tuple[str | None, list[str]]:
    """Every byte of the ranges in DEST against the source, stopping at the first difference.

    Returns (where DEST first differs, None when it does not; the source's sha256 per range).
    Each chunk's source and DEST bytes are read into one of COMPARE_PAIRS buffer pairs by two
    reader threads, compared here, and the source's bytes hashed by a hasher thread (hashlib
    releases the GIL: sha256, most of the compare's CPU, runs on another core while the next
    chunk is read and compared); a pair is read into again once its hash is done, so memory
    stays at 2 x COMPARE_PAIRS chunks.
    """
    dest = plan.request.dest
    chunk_bytes = plan.request.chunk_bytes
    hashes = [hashlib.sha256() for _ in plan.ranges]
    total = plan.copy_bytes
    last_report = 0.0
    # (source buffer, DEST buffer, the hash of its last chunk: the source buffer is free once
    # it is done), in the order they are read into.
    free: deque[tuple[bytearray, bytearray, Future[None] | None]] = deque(
        (bytearray(chunk_bytes), bytearray(chunk_bytes), None) for _ in range(COMPARE_PAIRS)
    )
    # (chunk, its pair's buffers, their reads), in chunk order.
    reading: deque[tuple[Chunk, bytearray, bytearray, Future[memoryview], Future[memoryview]]] = (
        deque()
    )
    chunks = iter_chunks(plan.ranges, chunk_bytes, 0)
    previous: Chunk | None = None

    def read(fd: int, path: str, buffer: bytearray, chunk: Chunk, drop_from: int) -> memoryview:
        data = memoryview(buffer)[: chunk.length]
        _pread_exact(fd, data, chunk.offset, path)
        # From the previous chunk's start: DONTNEED keeps a folio partly outside what it is
        # given, so a readahead folio straddling two chunks goes once both are read.
        end = chunk.offset + chunk.length
        os.posix_fadvise(fd, drop_from, end - drop_from, os.POSIX_FADV_DONTNEED)
        return data

    with (
        ThreadPoolExecutor(max_workers=2, thread_name_prefix="staging-compare-read") as readers,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="staging-compare-hash") as hasher,
    ):

        def read_next() -> None:
            nonlocal previous
            chunk = next(chunks, None)
            if chunk is None:
                return
            source_buffer, dest_buffer, hashed = free.popleft()
            if hashed is not None:
                hashed.result()
            same_range = previous is not None and previous.range_index == chunk.range_index
            drop_from = previous.offset if previous and same_range else chunk.offset
            previous = chunk
            reading.append(
                (
                    chunk,
                    source_buffer,
                    dest_buffer,
                    readers.submit(read, src_fd, plan.source, source_buffer, chunk, drop_from),
                    readers.submit(read, dst_fd, dest, dest_buffer, chunk, drop_from),
                )
            )

        for _ in range(COMPARE_PAIRS):
            read_next()
        while reading:
            chunk, source_buffer, dest_buffer, source_read, dest_read = reading.popleft()
            source_bytes, dest_bytes = source_read.result(), dest_read.result()
            # startswith compares with memcmp; == on memoryviews compares item by item.
            if not dest_buffer.startswith(source_bytes):
                offset = chunk.offset + _first_difference(source_bytes, dest_bytes)
                begin, end = plan.ranges[chunk.range_index]
                return (
                    f"its byte {offset} (of range [{begin}, {end})) differs from the source's",
                    [],
                )
            # One hasher thread: each range's chunks are hashed in order.
            hashed = hasher.submit(hashes[chunk.range_index].update, source_bytes)
            free.append((source_buffer, dest_buffer, hashed))
            now = time.monotonic()
            if now - last_report >= PROGRESS_INTERVAL_S:
                progress(chunk.copied_through, total)
                last_report = now
            read_next()
        for _source_buffer, _dest_buffer, last_hash in free:
            if last_hash is not None:
                last_hash.result()
    progress(total, total)
    return None, [digest.hexdigest() for digest in hashes]


def _first_difference(first: memoryview, second: memoryview) -> int:
    return next(i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b)


def _held_rank(plan: CopyPlan, src_fd: int, dst_fd: int) -> int | None:
    """The other rank (same TP size) whose rows DEST holds, judged on a sample of each range's
    ends; None when none does."""
    for rank, ranges in sorted(plan.other_rank_ranges.items()):
        if ranges and all(_sample_matches(src_fd, dst_fd, begin, end) for begin, end in ranges):
            return rank
    return None


def _sample_matches(src_fd: int, dst_fd: int, begin: int, end: int) -> bool:
    length = min(RANK_SAMPLE_BYTES, end - begin)
    for offset in {begin, end - length}:
        expected = os.pread(src_fd, length, offset)
        # Rows of zeros would match the holes of any sparse copy: they tell nothing.
        if expected.count(0) == len(expected) or os.pread(dst_fd, length, offset) != expected:
            return False
    return True


def _adopted_extents(fd: int, plan: CopyPlan) -> tuple[bool, str | None]:
    """(holes checked, a note on what DEST allocates beyond a sparse copy of the ranges)."""
    extents = _data_extents(fd, plan.size)
    allocated = os.fstat(fd).st_blocks * 512
    whole = extents == [(0, plan.size)] and plan.ranges != [(0, plan.size)]
    if extents is None or (whole and allocated < plan.size):
        return False, None  # the filesystem does not report holes
    outside = _outside(extents, plan, os.fstat(fd).st_blksize)
    if not outside:
        return True, None
    what = "fully materialised (no holes)" if whole else f"data outside the ranges at {outside}"
    return False, (
        f"adopted as it is, {what}: it allocates {allocated / 1e9:.2f} GB for a share of "
        f"{plan.copy_bytes / 1e9:.2f} GB; a sparse copy would take its place if it were removed "
        "(once no other lane uses it) and the step run again"
    )


def resume_point(plan: CopyPlan) -> int:
    """Bytes of the copy already durable in DEST.partial (0: start afresh)."""
    dest = plan.request.dest
    journal = _read_json(dest + JOURNAL_SUFFIX)
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
            raise StagingFailure(
                "no_space",
                f"{probe} has {free / 1e9:.2f} GB free but the sparse copy of "
                f"{' and '.join(files)} there needs {needed / 1e9:.2f} GB more; free space "
                "there or move the recipe's [[composed_model.local_files]] host path to a bigger"
                " disk (on the filesystem of the inventory's composed_root)",
            )


@dataclass(frozen=True)
class Checked:
    """One shard once checked: a manifest when DEST needs no copy, else where the copy resumes."""

    plan: CopyPlan
    manifest: dict[str, Any] | None
    status: str  # of a DEST that needs no copy: "skipped" or "adopted"
    resume_from: int
    seconds: float


def stage_all(requests: Sequence[Request], emit: Emit) -> None:
    """Check every shard, then make (or find, adopt or finish) each verified copy, emitting
    results."""

    def progress_of(dest: str, phase: str) -> Progress:
        # phase: "copy" (bytes copied and verified) or "compare" (DEST checked for adoption).
        def progress(done: int, total: int) -> None:
            emit({"progress": {"dest": dest, "done": done, "total": total, "phase": phase}})

        return progress

    checked: list[Checked] = []
    for request in requests:
        started = time.monotonic()
        with _about(request.dest):
            plan = plan_copy(request)
            manifest = find_reusable(plan)
            status = "skipped"
            if manifest is None:
                manifest = adopt(plan, progress_of(request.dest, "compare"))
                status = "adopted"
            resume_from = 0 if manifest else resume_point(plan)
        checked.append(
            Checked(plan, manifest, status, resume_from, round(time.monotonic() - started, 3))
        )
    pending = [(item.plan, item.resume_from) for item in checked if item.manifest is None]
    check_space(pending)
    emit({"plan": {"remaining_bytes": sum(plan.copy_bytes - done for plan, done in pending)}})
    for item in checked:
        if item.manifest is not None:
            result = _result(item.plan, item.status, item.manifest, copied=0, seconds=item.seconds)
        else:
            dest = item.plan.request.dest
            with _about(dest):
                result = stage(item.plan, item.resume_from, progress_of(dest, "copy"))
        emit({"result": dataclasses.asdict(result)})


def preview_all(requests: Sequence[Request], emit: Emit) -> None:
    """What stage_all would do with each shard, from the same checks, writing nothing: one
    {"preview": {"dest", "action", "bytes", "why"}} line per shard. action: "skip" (a verified
    copy is there), "adopt" (DEST matches the source where the dry run looks: stage_all compares
    the ranges, `bytes`, and adopts it unless a byte differs),
    "copy" or "resume" (`bytes` to write), "refuse" (what stage_all would fail with). An
    "adopt" is judged on DEST's size, header, extents and both ends of each range
    (_sampled_mismatch), not on every byte: a difference inside a range makes stage_all copy."""
    previews: list[dict[str, Any]] = []
    pending: list[tuple[CopyPlan, int]] = []
    for request in requests:
        try:
            with _about(request.dest):
                plan = plan_copy(request)
                action, count, why, resume_from = _preview_shard(plan)
        except StagingFailure as failure:
            action, count, why = "refuse", 0, f"[{failure.kind}] {failure}"
        else:
            if action in ("copy", "resume"):
                pending.append((plan, resume_from))
        previews.append({"dest": request.dest, "action": action, "bytes": count, "why": why})
    try:
        check_space(pending)
    except StagingFailure as failure:
        for preview in previews:
            if preview["action"] in ("copy", "resume"):
                preview.update(action="refuse", why=f"[{failure.kind}] {failure}")
    for preview in previews:
        emit({"preview": preview})


def _preview_shard(plan: CopyPlan) -> tuple[str, int, str, int]:
    """(action, bytes, why, bytes already durable) of one checked shard, as stage_all and adopt
    would decide, reading only."""
    request = plan.request
    dest = request.dest
    if find_reusable(plan) is not None:
        return "skip", 0, "a verified copy for this plan is there (its manifest matches)", 0
    try:
        before = os.stat(dest)
    except FileNotFoundError:
        before = None
    if before is not None:
        with open(plan.source, "rb") as source, open(dest, "rb") as existing:
            src_fd, dst_fd = source.fileno(), existing.fileno()
            if before.st_size != plan.size:
                mismatch: str | None = f"it is {before.st_size} bytes, the source {plan.size}"
            elif os.pread(dst_fd, plan.header_bytes, 0) != os.pread(src_fd, plan.header_bytes, 0):
                mismatch = "its safetensors header differs from the source's"
            else:
                mismatch = _sampled_mismatch(plan, src_fd, dst_fd)
                _holes_checked, note = _adopted_extents(dst_fd, plan)
            held = None
            if mismatch is not None and not _own_manifest(dest, before):
                held = _held_rank(plan, src_fd, dst_fd)
        if mismatch is None:
            return (
                "adopt",
                plan.copy_bytes,
                f"{dest} (no manifest of this plan) has the source's size and header, and its"
                f" ranges' ends match: adopted after comparing its ranges, {plan.copy_bytes} B,"
                " with the source (a byte that differs makes it a copy instead)"
                + (f"; {note}" if note else ""),
                0,
            )
        if held is not None:
            return "refuse", 0, f"[wrong_rank] {dest} holds rank {held}'s rows ({mismatch})", 0
        links = _links_elsewhere(request, before)
        if links:
            return "refuse", 0, f"[linked_mismatch] {dest} ({mismatch}) is linked: {links}", 0
    resume_from = resume_point(plan)
    replaced = f"; replaces {dest} ({mismatch})" if before is not None else ""
    if resume_from:
        left = plan.copy_bytes - resume_from
        why = f"resumes the copy at byte {resume_from} of {plan.copy_bytes}{replaced}"
        return "resume", left, why, resume_from
    return "copy", plan.copy_bytes, f"sparse copy of {plan.copy_bytes} B{replaced}", 0


def _sampled_mismatch(plan: CopyPlan, src_fd: int, dst_fd: int) -> str | None:
    """Where DEST differs from the source at either end of one of the plan's ranges (None: it
    does not there): the dry run's stand-in for the full compare, which tells another rank's
    copy (same size and header) from this one's at RANK_SAMPLE_BYTES a range end."""
    for begin, end in plan.ranges:
        length = min(RANK_SAMPLE_BYTES, end - begin)
        for offset in sorted({begin, end - length}):
            if os.pread(dst_fd, length, offset) != os.pread(src_fd, length, offset):
                return f"its bytes at [{offset}, {offset + length}) differ from the source's"
    return None


@contextlib.contextmanager
def _about(dest: str) -> Iterator[None]:
    """Failures inside name the copy they are about; an OSError becomes an "io" failure."""
    try:
        yield
    except StagingFailure as failure:
        failure.dest = dest
        raise
    except OSError as exc:
        where = f"{exc.filename or dest}: {exc.strerror or exc}"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            io_failure = StagingFailure(
                "no_space",
                f"{where}: the disk filled up during the copy; free space there or move"
                " the recipe's [[composed_model.local_files]] host path to a bigger disk (a"
                " re-run resumes from what is durable)",
            )
        else:
            io_failure = StagingFailure("io", where)
        io_failure.dest = dest
        raise io_failure from exc


def stage(plan: CopyPlan, resume_from: int, progress: Progress) -> StagingResult:
    """Copy, verify and put in place one checked plan (resume_from bytes already durable)."""
    started = time.monotonic()
    dest = plan.request.dest
    partial = dest + PARTIAL_SUFFIX
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if resume_from == 0:
        _remove(dest + JOURNAL_SUFFIX)
        _remove(partial)
    src_fd = os.open(plan.source, os.O_RDONLY)
    dst_fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(dst_fd, plan.size)
        # No readahead: it would cache bytes past the ranges' ends that no DONTNEED of a copied
        # chunk covers; the reader asks for the next chunk itself (WILLNEED).
        os.posix_fadvise(src_fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.posix_fadvise(dst_fd, 0, 0, os.POSIX_FADV_RANDOM)
        range_sums, copied = _copy_and_verify(plan, src_fd, dst_fd, resume_from, progress)
        holes_checked = _check_extents(dst_fd, plan, partial)
        os.fsync(dst_fd)
    except StagingFailure as failure:
        if failure.kind == "verify_failed":
            _remove(dest + JOURNAL_SUFFIX)
        raise
    finally:
        os.close(src_fd)
        os.close(dst_fd)
    os.replace(partial, dest)
    manifest = _write_manifest(plan, os.stat(dest), range_sums, holes_checked, note=None)
    _remove(dest + JOURNAL_SUFFIX)
    _fsync_dir(os.path.dirname(dest))
    status = "resumed" if resume_from else "copied"
    seconds = round(time.monotonic() - started, 3)
    return _result(plan, status, manifest, copied=copied, seconds=seconds)


def _write_manifest(
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
    _write_json(dest + MANIFEST_SUFFIX, manifest)
    return manifest


def _result(
    plan: CopyPlan, status: str, manifest: dict[str, Any], *, copied: int, seconds: float
) -> StagingResult:
    stat = os.stat(plan.request.dest)
    return StagingResult(
        node=plan.request.node,
        status=status,
        dest=plan.request.dest,
        source=plan.source,
        size=plan.size,
        ranks=plan.request.ranks,
        tp_size=plan.request.tp_size,
        header_bytes=plan.header_bytes,
        share_bytes=plan.copy_bytes - plan.header_bytes,
        copied_bytes=copied,
        allocated_bytes=stat.st_blocks * 512,
        ranges=tuple((begin, end) for begin, end in manifest["ranges"]),
        range_sha256=tuple(manifest["range_sha256"]),
        holes_checked=manifest["holes_checked"],
        seconds=seconds,
        note=manifest.get("note"),
    )


def iter_chunks(
    ranges: Sequence[tuple[int, int]], chunk_bytes: int, resume_from: int
) -> Iterator[Chunk]:
    """The ranges in chunks of at most chunk_bytes, none straddling resume_from (a resumed run
    may use another chunk size than the run that stopped)."""
    copied_through = 0
    for index, (begin, end) in enumerate(ranges):
        offset = begin
        while offset < end:
            length = min(chunk_bytes, end - offset)
            if copied_through < resume_from < copied_through + length:
                length = resume_from - copied_through
            copied_through += length
            yield Chunk(index, offset, length, copied_through)
            offset += length


def _copy_and_verify(
    plan: CopyPlan, src_fd: int, dst_fd: int, resume_from: int, progress: Progress
) -> tuple[list[str], int]:
    """Copy the chunks past resume_from; compare every chunk of DEST with the source's bytes.

    Returns (the source's sha256 per range, bytes written this run).
    """
    request = plan.request
    partial = request.dest + PARTIAL_SUFFIX
    range_hashes = [hashlib.sha256() for _ in plan.ranges]
    free_buffers: queue.Queue[bytearray] = queue.Queue()
    for _ in range(CHUNK_BUFFERS):
        free_buffers.put(bytearray(request.chunk_bytes))
    to_write: queue.Queue[tuple[Chunk, bytearray] | None] = queue.Queue()
    to_hash: queue.Queue[tuple[Chunk, bytearray] | None] = queue.Queue()
    abort = threading.Event()
    failures: list[BaseException] = []
    copied = 0
    total = plan.copy_bytes

    def take(source: queue.Queue[T]) -> T:
        while True:
            if abort.is_set():
                raise _Aborted
            try:
                return source.get(timeout=QUEUE_POLL_S)
            except queue.Empty:
                continue

    def write_and_verify() -> None:
        nonlocal copied
        read_back = bytearray(request.chunk_bytes)
        read_back_view = memoryview(read_back)
        written_chunks = 0
        unsynced: list[Chunk] = []
        last_report = 0.0

        def make_durable() -> None:
            os.fdatasync(dst_fd)
            # Clean now, so DONTNEED drops them (on dirty pages it only starts their writeback).
            for chunk in unsynced:
                os.posix_fadvise(dst_fd, chunk.offset, chunk.length, os.POSIX_FADV_DONTNEED)
            _write_json(
                request.dest + JOURNAL_SUFFIX,
                {"key": plan.key, "copied_through": unsynced[-1].copied_through},
            )
            unsynced.clear()

        while (item := take(to_write)) is not None:
            chunk, buffer = item
            source_bytes = memoryview(buffer)[: chunk.length]
            fresh = chunk.copied_through > resume_from
            if fresh:
                _pwrite_all(dst_fd, source_bytes, chunk.offset)
            # A fresh chunk reads back from the page cache, a resumed one from the disk.
            _pread_exact(dst_fd, read_back_view[: chunk.length], chunk.offset, partial)
            # startswith compares with memcmp; == on memoryviews compares item by item.
            if not read_back.startswith(source_bytes):
                raise StagingFailure(
                    "verify_failed",
                    f"{partial}: bytes [{chunk.offset}, {chunk.offset + chunk.length}) read "
                    f"back differ from {plan.source}; the local disk is failing or another "
                    "process writes this file; the next run starts the copy afresh",
                )
            to_hash.put((chunk, buffer))
            if not fresh:
                os.posix_fadvise(dst_fd, chunk.offset, chunk.length, os.POSIX_FADV_DONTNEED)
            if fresh:
                unsynced.append(chunk)
                copied += chunk.length
                written_chunks += 1
            now = time.monotonic()
            if now - last_report >= PROGRESS_INTERVAL_S:
                progress(chunk.copied_through, total)
                last_report = now
            stop_after = request.stop_after_chunks
            if stop_after is not None and written_chunks >= stop_after:
                make_durable()
                raise StagingFailure(
                    "interrupted",
                    f"stopped on request after {written_chunks} chunks "
                    f"({chunk.copied_through} of {total} bytes durable)",
                )
            if sum(written.length for written in unsynced) >= request.sync_bytes:
                make_durable()
        if unsynced:
            make_durable()
        to_hash.put(None)
        progress(total, total)

    def hash_chunks() -> None:
        while (item := take(to_hash)) is not None:
            chunk, buffer = item
            range_hashes[chunk.range_index].update(memoryview(buffer)[: chunk.length])
            free_buffers.put(buffer)

    def guarded(body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except _Aborted:
                pass
            except BaseException as exc:
                failures.append(exc)
                abort.set()

        return run

    threads = [
        threading.Thread(target=guarded(write_and_verify), name="staging-writer", daemon=True),
        threading.Thread(target=guarded(hash_chunks), name="staging-hasher", daemon=True),
    ]
    for thread in threads:
        thread.start()

    def read_chunks() -> None:
        chunks = iter_chunks(plan.ranges, request.chunk_bytes, resume_from)
        following = next(chunks, None)
        while (chunk := following) is not None:
            following = next(chunks, None)
            if following is not None:
                os.posix_fadvise(src_fd, following.offset, following.length, os.POSIX_FADV_WILLNEED)
            buffer = take(free_buffers)
            data = memoryview(buffer)[: chunk.length]
            _pread_exact(src_fd, data, chunk.offset, plan.source)
            os.posix_fadvise(src_fd, chunk.offset, chunk.length, os.POSIX_FADV_DONTNEED)
            to_write.put((chunk, buffer))
        to_write.put(None)

    guarded(read_chunks)()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return [digest.hexdigest() for digest in range_hashes], copied


def _pread_exact(fd: int, data: memoryview, offset: int, path: str) -> None:
    got = 0
    while got < len(data):
        count = os.preadv(fd, [data[got:]], offset + got)
        if count == 0:
            raise StagingFailure(
                "io",
                f"{path} ended at byte {offset + got} while reading [{offset}, "
                f"{offset + len(data)}); the file changed during the copy, run the step again",
            )
        got += count


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _check_extents(fd: int, plan: CopyPlan, path: str) -> bool:
    """Data exactly where the ranges are (to the block), holes elsewhere.

    False when the filesystem does not report holes (SEEK_DATA unsupported, or the whole file
    reported as data although it is allocated sparsely).
    """
    extents = _data_extents(fd, plan.size)
    if extents is None:
        return False
    allocated = os.fstat(fd).st_blocks * 512
    if extents == [(0, plan.size)] and merge_ranges(plan.ranges) != [(0, plan.size)]:
        if allocated < plan.size:
            return False
        raise StagingFailure(
            "not_sparse",
            f"{path}: the filesystem allocated all {plan.size} bytes of the sparse copy; it "
            "does not keep holes, so each rank would cost the full shard; move the recipe's "
            "[[composed_model.local_files]] host path to a filesystem with sparse files (ext4,"
            " xfs, btrfs)",
        )
    outside = _outside(extents, plan, os.fstat(fd).st_blksize)
    if outside:
        raise StagingFailure(
            "verify_failed",
            f"{path}: data at {outside} outside this rank's ranges; "
            "the next run starts the copy afresh",
        )
    for begin, end in plan.ranges:
        if not any(start <= begin and end <= stop for start, stop in extents):
            raise StagingFailure(
                "verify_failed",
                f"{path}: range [{begin}, {end}) is not all data; the next run starts afresh",
            )
    return True


def _data_extents(fd: int, size: int) -> list[tuple[int, int]] | None:
    """The file's data extents (SEEK_DATA/SEEK_HOLE); None when the filesystem has no such
    seeks."""
    extents: list[tuple[int, int]] = []
    position = 0
    while position < size:
        try:
            start = os.lseek(fd, position, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                break
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return None
            raise
        position = os.lseek(fd, start, os.SEEK_HOLE)
        extents.append((start, position))
    return extents


def _outside(extents: Sequence[tuple[int, int]], plan: CopyPlan, block: int) -> str:
    """The first data extent outside the ranges, as "[start, end)"; "" when there is none.

    A range's data may reach the blocks its ends fall in (the filesystem allocates whole
    blocks), not further.
    """
    allowed = merge_ranges(
        (begin // block * block, -(-end // block) * block) for begin, end in plan.ranges
    )
    for start, end in extents:
        if not any(low <= start and end <= high for low, high in allowed):
            return f"[{start}, {end})"
    return ""


def _drop_cached(path: str) -> None:
    """Drop a file's clean pages, e.g. the readahead (megabytes) a header read pulled in."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as json_file:
            data = json.load(json_file)
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: str, data: dict[str, Any]) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as json_file:
        json.dump(data, json_file, indent=1)
    os.replace(temporary, path)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


def main(argv: Sequence[str]) -> int:
    (request_json,) = argv
    node = json.loads(request_json)
    requests = [Request.from_json(node, stage) for stage in node["stages"]]
    try:
        (preview_all if node.get("dry_run") else stage_all)(requests, _emit)
    except StagingFailure as failure:
        _emit({"ok": False, "kind": failure.kind, "message": str(failure), "dest": failure.dest})
        return FAILED_EXIT
    except OSError as exc:
        message = f"{exc.filename or 'staging'}: {exc.strerror or exc}"
        _emit({"ok": False, "kind": "io", "message": message, "dest": None})
        return FAILED_EXIT
    _emit({"ok": True})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
