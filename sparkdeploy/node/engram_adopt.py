"""Adoption of a DEST already there, ON the node (standard library + shipped modules; part of
the sparkdeploy.node.engram_copy script).

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

The dry run (a preview) judges the same DEST on samples, writing nothing: preview_adoption.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sparkdeploy.errors import StagingError
from sparkdeploy.node.engram_plan import (
    JOURNAL_SUFFIX,
    MIB,
    CopyPlan,
    Progress,
    Request,
    write_manifest,
)
from sparkdeploy.node.sparse_copy import (
    PROGRESS_INTERVAL_S,
    Chunk,
    data_extents,
    first_extent_outside,
    iter_chunks,
    pread_exact,
)
from sparkdeploy.node.staged_file import (
    MANIFEST_SUFFIX,
    PARTIAL_SUFFIX,
    fsync_dir,
    read_json,
    remove,
    same_inode_under,
)

# Chunk buffer pairs (source, DEST) of an adoption's compare: one is read into while the other is
# compared and hashed.
COMPARE_PAIRS = 2
# Bytes compared at each end of each of another rank's ranges to tell whether DEST holds them
# (only for the wrong_rank message, so a sample: a full compare would read the share again).
RANK_SAMPLE_BYTES = 1 * MIB


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
            raise StagingError(
                f"{dest} changed while it was compared with {plan.source}; another process "
                "writes it: stop it, then run the step again",
                kind="io",
            )
        manifest = write_manifest(plan, after, range_sums, holes_checked, note=note)
        remove(dest + JOURNAL_SUFFIX)
        remove(dest + PARTIAL_SUFFIX)
        fsync_dir(os.path.dirname(dest))
        return manifest
    ranks = ", ".join(map(str, request.ranks))
    wanted = f"rank{'s' if len(request.ranks) > 1 else ''} {ranks} of TP {request.tp_size}"
    links = _links_elsewhere(request, before)
    if held is not None:
        shared = f", {before.st_nlink} hard links" if before.st_nlink > 1 else ""
        raise StagingError(
            f"{dest} holds rank {held}'s rows, this plan gives node {request.node} {wanted}: "
            f"{mismatch}, but its header and a sample of rank {held}'s rows match {plan.source}"
            f"; it is no copy of ours (no manifest{shared}), so it is left alone; the deploy "
            "cannot reorder the ranks: list the nodes in the order the file was made for, or "
            "point the recipe's [[composed_model.local_files]] host path at another path, or, "
            f"once no other lane uses it, remove or rename {dest} by hand",
            kind="wrong_rank",
        )
    if links:
        raise StagingError(
            f"{dest} does not match {plan.source} for {wanted} ({mismatch}) and has "
            f"{before.st_nlink} hard links (other than itself: {links}): other lanes may use it,"
            " and a new copy would leave them on the old file and take "
            f"{plan.copy_bytes / 1e9:.2f} GB more here; check what the other lanes need, then "
            f"remove or rename {dest} by hand, or point the recipe's "
            "[[composed_model.local_files]] host path at another path",
            kind="linked_mismatch",
        )
    return None


def _own_manifest(dest: str, stat: os.stat_result) -> bool:
    """Whether DEST is a copy of ours: a manifest describes this very file (of any plan)."""
    recorded = (read_json(dest + MANIFEST_SUFFIX) or {}).get("dest", {})
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
        found = same_inode_under(searched, stat)
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
        pread_exact(fd, data, chunk.offset, path)
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
    extents = data_extents(fd, plan.size)
    allocated = os.fstat(fd).st_blocks * 512
    whole = extents == [(0, plan.size)] and plan.ranges != [(0, plan.size)]
    if extents is None or (whole and allocated < plan.size):
        return False, None  # the filesystem does not report holes
    outside = first_extent_outside(extents, plan, os.fstat(fd).st_blksize)
    if not outside:
        return True, None
    what = "fully materialised (no holes)" if whole else f"data outside the ranges at {outside}"
    return False, (
        f"adopted as it is, {what}: it allocates {allocated / 1e9:.2f} GB for a share of "
        f"{plan.copy_bytes / 1e9:.2f} GB; a sparse copy would take its place if it were removed "
        "(once no other lane uses it) and the step run again"
    )


def preview_adoption(plan: CopyPlan, before: os.stat_result) -> tuple[str, str]:
    """What adopt would make of the DEST of this stat, judged on samples, reading only:
    ("adopt", why), ("refuse", why) or ("replace", where DEST differs)."""
    request = plan.request
    dest = request.dest
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
            f"{dest} (no manifest of this plan) has the source's size and header, and its"
            f" ranges' ends match: adopted after comparing its ranges, {plan.copy_bytes} B,"
            " with the source (a byte that differs makes it a copy instead)"
            + (f"; {note}" if note else ""),
        )
    if held is not None:
        return "refuse", f"[wrong_rank] {dest} holds rank {held}'s rows ({mismatch})"
    links = _links_elsewhere(request, before)
    if links:
        return "refuse", f"[linked_mismatch] {dest} ({mismatch}) is linked: {links}"
    return "replace", mismatch


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
