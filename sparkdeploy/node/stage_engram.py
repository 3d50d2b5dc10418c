"""The Engram sparse copies of one node, as they run ON the node (standard library + two
shipped modules).

sparkdeploy.steps.stage_engram ships this module with sparkdeploy.node.engram and
sparkdeploy.node.hfcache (see sparkdeploy.remote.node_script) and calls `main([request_json])` once
per node for all its shards. It prints JSON lines on stdout as it goes: {"plan": ...} once every
shard is checked, {"progress": ...} while a copy runs, {"result": ...} per shard, and {"ok": true}
last; a deliberate failure ends with {"ok": false, "kind": ..., "message": ..., "dest": ...} and
exit status FAILED_EXIT.

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
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
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
# Written bytes between two fdatasyncs (each a journal entry); they stay dirty in the page cache
# until then. Measured on one disk with the source: one batch of writes per sync beats starting
# each chunk's writeback as it is written (reads and writes interleave less). Syncing rarely
# would keep more dirty pages and lose more work to an interruption.
DEFAULT_SYNC_BYTES = 128 * MIB
FAILED_EXIT = 3
PROGRESS_INTERVAL_S = 1.0
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
    """One shard to stage: the plan's EngramStage (sparkdeploy.model.plan) as it arrives here,
    with what the node's request says for all its shards."""

    node: str
    nas_hf_cache: str
    repo: str
    revision: str | None
    filename: str
    dest: str
    ranks: tuple[int, ...]
    tp_size: int
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    sync_bytes: int = DEFAULT_SYNC_BYTES
    # Fault injection for tests: fail as if killed after writing this many chunks in this run.
    stop_after_chunks: int | None = None

    @classmethod
    def from_json(cls, node: dict[str, Any], stage: dict[str, Any]) -> Request:
        """One stage of a node request: {"node", "nas_hf_cache", "chunk_bytes", "sync_bytes",
        "stop_after_chunks", "stages": [EngramStage as JSON, ...]}."""
        return cls(
            node=node["node"],
            nas_hf_cache=node["nas_hf_cache"],
            repo=stage["repo"]["repo"],
            revision=stage["repo"].get("revision"),
            filename=stage["filename"],
            dest=stage["dest"],
            ranks=tuple(sorted(stage["ranks"])),
            tp_size=stage["tp_size"],
            chunk_bytes=node.get("chunk_bytes", DEFAULT_CHUNK_BYTES),
            sync_bytes=node.get("sync_bytes", DEFAULT_SYNC_BYTES),
            stop_after_chunks=node.get("stop_after_chunks"),
        )


@dataclass(frozen=True)
class StagingResult:
    """One staged shard, as the node reports it (a {"result": ...} line) and the flow reads it."""

    node: str
    status: str  # "copied", "resumed" or "skipped"
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
                "file is not an Engram shard of this model"
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
            "model; remove it from the recipe's local_files or fix the repo",
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
                "there or point engram_root at a bigger disk",
            )


def stage_all(requests: Sequence[Request], emit: Emit) -> None:
    """Check every shard, then make (or find, or finish) each verified copy, emitting results."""
    started = time.monotonic()
    # (plan, the manifest of a reusable copy, bytes already durable in DEST.partial)
    checked: list[tuple[CopyPlan, dict[str, Any] | None, int]] = []
    for request in requests:
        with _about(request.dest):
            plan = plan_copy(request)
            manifest = find_reusable(plan)
            checked.append((plan, manifest, 0 if manifest else resume_point(plan)))
    pending = [(plan, resumed) for plan, manifest, resumed in checked if manifest is None]
    check_space(pending)
    emit({"plan": {"remaining_bytes": sum(plan.copy_bytes - done for plan, done in pending)}})
    for plan, manifest, resumed in checked:
        if manifest is not None:
            result = _result(plan, "skipped", manifest, copied=0, started=started)
        else:

            def progress(done: int, total: int, dest: str = plan.request.dest) -> None:
                emit({"progress": {"dest": dest, "done": done, "total": total}})

            with _about(plan.request.dest):
                result = stage(plan, resumed, progress)
        emit({"result": dataclasses.asdict(result)})
        started = time.monotonic()


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
                f"{where}: the disk filled up during the copy; free space there or point"
                " engram_root at a bigger disk (a re-run resumes from what is durable)",
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
    stat = os.stat(dest)
    manifest = {
        **plan.key,
        "range_sha256": range_sums,
        "header_bytes": plan.header_bytes,
        "rows": plan.rows,
        "holes_checked": holes_checked,
        "dest": {"path": dest, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns},
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _write_json(dest + MANIFEST_SUFFIX, manifest)
    _remove(dest + JOURNAL_SUFFIX)
    _fsync_dir(os.path.dirname(dest))
    status = "resumed" if resume_from else "copied"
    return _result(plan, status, manifest, copied=copied, started=started)


def _result(
    plan: CopyPlan, status: str, manifest: dict[str, Any], *, copied: int, started: float
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
        seconds=round(time.monotonic() - started, 3),
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
    block = os.fstat(fd).st_blksize
    extents: list[tuple[int, int]] = []
    position = 0
    while position < plan.size:
        try:
            start = os.lseek(fd, position, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                break
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return False
            raise
        position = os.lseek(fd, start, os.SEEK_HOLE)
        extents.append((start, position))
    allocated = os.fstat(fd).st_blocks * 512
    if extents == [(0, plan.size)] and merge_ranges(plan.ranges) != [(0, plan.size)]:
        if allocated < plan.size:
            return False
        raise StagingFailure(
            "not_sparse",
            f"{path}: the filesystem allocated all {plan.size} bytes of the sparse copy; it "
            "does not keep holes, so each rank would cost the full shard; put engram_root on "
            "a filesystem with sparse files (ext4, xfs, btrfs)",
        )
    allowed = merge_ranges(
        (begin // block * block, -(-end // block) * block) for begin, end in plan.ranges
    )
    for start, end in extents:
        if not any(low <= start and end <= high for low, high in allowed):
            raise StagingFailure(
                "verify_failed",
                f"{path}: data at [{start}, {end}) outside this rank's ranges; "
                "the next run starts the copy afresh",
            )
    for begin, end in plan.ranges:
        if not any(start <= begin and end <= stop for start, stop in extents):
            raise StagingFailure(
                "verify_failed",
                f"{path}: range [{begin}, {end}) is not all data; the next run starts afresh",
            )
    return True


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
        stage_all(requests, _emit)
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
