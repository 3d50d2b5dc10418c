"""The sparse copy of one Engram shard ON the node (standard library + shipped modules; part of
the sparkdeploy.node.engram_copy script, which checks the shard first: engram_plan).

The copy: a file of the shard's full size holding the header and this node's ranks' row ranges
at their original offsets, holes elsewhere, written to DEST.partial in fixed-size chunks by
three threads passing a few reused buffers around (memory stays bounded):

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
"""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sparkdeploy.errors import StagingError
from sparkdeploy.node.engram import merge_ranges
from sparkdeploy.node.engram_plan import JOURNAL_SUFFIX, CopyPlan, Progress, write_manifest
from sparkdeploy.node.staged_file import PARTIAL_SUFFIX, fsync_dir, remove, write_json

# Chunk buffers passed from the reader to the writer to the hasher and back; the writer has one
# more for reading back.
CHUNK_BUFFERS = 5
PROGRESS_INTERVAL_S = 1.0
QUEUE_POLL_S = 0.2

T = TypeVar("T")


class _Aborted(Exception):
    """Another pipeline thread failed; this one stops quietly."""


@dataclass(frozen=True)
class Chunk:
    range_index: int
    offset: int
    length: int
    # Bytes of the whole copy up to the end of this chunk (the journal's unit).
    copied_through: int


def copy_sparse(plan: CopyPlan, resume_from: int, progress: Progress) -> tuple[dict[str, Any], int]:
    """Copy, verify and put in place one checked plan (resume_from bytes already durable).

    Returns (DEST's manifest, bytes written this run).
    """
    dest = plan.request.dest
    partial = dest + PARTIAL_SUFFIX
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if resume_from == 0:
        remove(dest + JOURNAL_SUFFIX)
        remove(partial)
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
    except StagingError as failure:
        if failure.kind == "verify_failed":
            remove(dest + JOURNAL_SUFFIX)
        raise
    finally:
        os.close(src_fd)
        os.close(dst_fd)
    os.replace(partial, dest)
    manifest = write_manifest(plan, os.stat(dest), range_sums, holes_checked, note=None)
    remove(dest + JOURNAL_SUFFIX)
    fsync_dir(os.path.dirname(dest))
    return manifest, copied


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
            write_json(
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
            pread_exact(dst_fd, read_back_view[: chunk.length], chunk.offset, partial)
            # startswith compares with memcmp; == on memoryviews compares item by item.
            if not read_back.startswith(source_bytes):
                raise StagingError(
                    f"{partial}: bytes [{chunk.offset}, {chunk.offset + chunk.length}) read "
                    f"back differ from {plan.source}; the local disk is failing or another "
                    "process writes this file; the next run starts the copy afresh",
                    kind="verify_failed",
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
                raise StagingError(
                    f"stopped on request after {written_chunks} chunks "
                    f"({chunk.copied_through} of {total} bytes durable)",
                    kind="interrupted",
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
            pread_exact(src_fd, data, chunk.offset, plan.source)
            os.posix_fadvise(src_fd, chunk.offset, chunk.length, os.POSIX_FADV_DONTNEED)
            to_write.put((chunk, buffer))
        to_write.put(None)

    guarded(read_chunks)()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return [digest.hexdigest() for digest in range_hashes], copied


def pread_exact(fd: int, data: memoryview, offset: int, path: str) -> None:
    got = 0
    while got < len(data):
        count = os.preadv(fd, [data[got:]], offset + got)
        if count == 0:
            raise StagingError(
                f"{path} ended at byte {offset + got} while reading [{offset}, "
                f"{offset + len(data)}); the file changed during the copy, run the step again",
                kind="io",
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
    extents = data_extents(fd, plan.size)
    if extents is None:
        return False
    allocated = os.fstat(fd).st_blocks * 512
    if extents == [(0, plan.size)] and merge_ranges(plan.ranges) != [(0, plan.size)]:
        if allocated < plan.size:
            return False
        raise StagingError(
            f"{path}: the filesystem allocated all {plan.size} bytes of the sparse copy; it "
            "does not keep holes, so each rank would cost the full shard; move the recipe's "
            "[[composed_model.local_files]] host path to a filesystem with sparse files (ext4,"
            " xfs, btrfs)",
            kind="not_sparse",
        )
    outside = first_extent_outside(extents, plan, os.fstat(fd).st_blksize)
    if outside:
        raise StagingError(
            f"{path}: data at {outside} outside this rank's ranges; "
            "the next run starts the copy afresh",
            kind="verify_failed",
        )
    for begin, end in plan.ranges:
        if not any(start <= begin and end <= stop for start, stop in extents):
            raise StagingError(
                f"{path}: range [{begin}, {end}) is not all data; the next run starts afresh",
                kind="verify_failed",
            )
    return True


def data_extents(fd: int, size: int) -> list[tuple[int, int]] | None:
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


def first_extent_outside(extents: Sequence[tuple[int, int]], plan: CopyPlan, block: int) -> str:
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
