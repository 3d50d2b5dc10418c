"""Engram sparse-copy staging: run sparkdeploy.node.stage_engram on a node, turn its answer into
data.

One python3 on the node per call, for all the node's shards: it checks them all (source,
header, geometry, free space), says how many bytes remain to copy, then copies and verifies
each, printing progress as it goes. The lines are read as they come (stream_lines), so progress
reaches the caller live and the deadline is sized from the bytes left once they are known.
See sparkdeploy.node.stage_engram for the copy itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

from sparkdeploy.errors import RemoteError, StagingError, TransientRemoteError
from sparkdeploy.node import engram
from sparkdeploy.node import hfcache as node_hfcache
from sparkdeploy.node import stage_engram as node_staging
from sparkdeploy.remote.node_script import (
    STDERR_TAIL_CHARS,
    build_node_script,
    python_argv,
)

# The longest the node script may stay silent: while it checks the shards (NAS lookups and
# header reads) and between two progress lines of a copy (one fdatasync of a slow disk).
SILENCE_TIMEOUT_S = 120.0
# The slowest NAS read rate that is still healthy; it sizes the copy's deadline.
MIN_COPY_BYTES_PER_S = 50 * 1000 * 1000
COPY_TIMEOUT_BASE_S = 300.0
# Bounds the stream as a whole; the node must print its plan within SILENCE_TIMEOUT_S, and from
# then on the deadline sized from the plan is checked at every line, so that one ends it first.
STREAM_BACKSTOP_S = 48 * 3600.0

ProgressCallback = Callable[[str, str, int, int], None]  # node, dest, done, total


class LineSource(Protocol):
    """The output lines of a running command: sparkdeploy.remote.ssh.LineStream."""

    exit_code: int | None

    def __iter__(self) -> Iterator[bytes]: ...
    def close(self) -> None: ...


class StreamRunner(Protocol):
    """What staging needs of a node: sparkdeploy.remote.ssh.Connection has this method."""

    def stream_lines(
        self, argv: Sequence[str], *, timeout: float, idle_timeout: float | None = None
    ) -> LineSource: ...


@dataclass(frozen=True)
class EngramShard:
    """One sparse copy to make on a node: the shard, its local path and the node's ranks."""

    repo: str
    revision: str | None
    filename: str
    dest: str
    ranks: tuple[int, ...]
    tp_size: int


@dataclass(frozen=True)
class StagingResult:
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


@cache
def node_script() -> str:
    return build_node_script(node_staging, [engram, node_hfcache])


def node_argv(request: dict[str, Any]) -> list[str]:
    """The node command for one request (see node_staging.Request.from_json)."""
    return python_argv(node_script(), [json.dumps(request)])


def stage_engram_shards(
    runner: StreamRunner,
    node: str,
    *,
    nas_hf_cache: str,
    shards: Sequence[EngramShard],
    on_progress: ProgressCallback | None = None,
    chunk_bytes: int = node_staging.DEFAULT_CHUNK_BYTES,
    sync_bytes: int = node_staging.DEFAULT_SYNC_BYTES,
    stop_after_chunks: int | None = None,
) -> list[StagingResult]:
    """Make (or find, or finish) the verified sparse copy of each shard on one node.

    stop_after_chunks is fault injection for tests: the node stops as if killed after writing
    that many chunks.
    """
    request: dict[str, Any] = {
        "nas_hf_cache": nas_hf_cache,
        "chunk_bytes": chunk_bytes,
        "sync_bytes": sync_bytes,
        "stop_after_chunks": stop_after_chunks,
        "shards": [
            {
                "repo": shard.repo,
                "revision": shard.revision,
                "filename": shard.filename,
                "dest": shard.dest,
                "ranks": list(shard.ranks),
                "tp_size": shard.tp_size,
            }
            for shard in shards
        ],
    }
    stream = runner.stream_lines(
        node_argv(request), timeout=STREAM_BACKSTOP_S, idle_timeout=SILENCE_TIMEOUT_S
    )
    results: list[StagingResult] = []
    answer: dict[str, Any] | None = None
    other_output: list[str] = []
    deadline: float | None = None
    for raw in stream:
        line = _json_object(raw)
        if line is None:
            other_output.append(raw.decode("utf-8", "replace"))
        elif "plan" in line:
            remaining = line["plan"]["remaining_bytes"]
            deadline = time.monotonic() + COPY_TIMEOUT_BASE_S + remaining / MIN_COPY_BYTES_PER_S
        elif "progress" in line:
            if on_progress is not None:
                progress = line["progress"]
                on_progress(node, progress["dest"], progress["done"], progress["total"])
        elif "result" in line:
            results.append(_staging_result(node, line["result"]))
        elif "ok" in line:
            answer = line
        if deadline is not None and time.monotonic() > deadline:
            stream.close()
            raise RemoteError(
                f"node {node}: staging {_describe(shards)} did not finish by its deadline (the "
                f"bytes left at {MIN_COPY_BYTES_PER_S / 1e6:.0f} MB/s plus "
                f"{COPY_TIMEOUT_BASE_S:.0f} s); the NAS or the local disk is too slow; a re-run "
                "resumes the copy"
            )
    if answer is None:
        tail = "\n".join(other_output)[-STDERR_TAIL_CHARS:]
        if stream.exit_code is None:
            raise TransientRemoteError(
                f"node {node}: the staging script for {_describe(shards)} stopped without an "
                f"answer or exit status (connection lost, or silent for {SILENCE_TIMEOUT_S:.0f} "
                f"s); a re-run resumes the copy; its output ends with: {tail}"
            )
        how = (
            "was killed by a signal (SSH reports exit status -1)"
            if stream.exit_code == -1
            else f"exited {stream.exit_code}"
        )
        raise RemoteError(
            f"node {node}: the staging script for {_describe(shards)} {how} without an answer;"
            f" a re-run resumes the copy; its output ends with: {tail or '(nothing)'}"
        )
    if not answer["ok"]:
        failed = [shard for shard in shards if shard.dest == answer.get("dest")] or shards
        raise StagingError(
            f"node {node}: staging {_describe(failed)} failed [{answer['kind']}]: "
            f"{answer['message']}"
        )
    return results


def stage_engram(
    runner: StreamRunner,
    node: str,
    *,
    nas_hf_cache: str,
    repo: str,
    revision: str | None,
    filename: str,
    dest: str,
    ranks: Sequence[int],
    tp_size: int,
    on_progress: ProgressCallback | None = None,
    chunk_bytes: int = node_staging.DEFAULT_CHUNK_BYTES,
    sync_bytes: int = node_staging.DEFAULT_SYNC_BYTES,
    stop_after_chunks: int | None = None,
) -> StagingResult:
    """stage_engram_shards for a single shard."""
    shard = EngramShard(repo, revision, filename, dest, tuple(ranks), tp_size)
    (result,) = stage_engram_shards(
        runner,
        node,
        nas_hf_cache=nas_hf_cache,
        shards=[shard],
        on_progress=on_progress,
        chunk_bytes=chunk_bytes,
        sync_bytes=sync_bytes,
        stop_after_chunks=stop_after_chunks,
    )
    return result


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        line = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return line if isinstance(line, dict) else None


def _describe(shards: Sequence[EngramShard]) -> str:
    return "; ".join(
        f"{shard.repo}/{shard.filename} to {shard.dest} (ranks {list(shard.ranks)} of TP "
        f"{shard.tp_size})"
        for shard in shards
    )


def _staging_result(node: str, result: dict[str, Any]) -> StagingResult:
    return StagingResult(
        node=node,
        status=result["status"],
        dest=result["dest"],
        source=result["source"],
        size=result["size"],
        ranks=tuple(result["ranks"]),
        tp_size=result["tp_size"],
        header_bytes=result["header_bytes"],
        share_bytes=result["share_bytes"],
        copied_bytes=result["copied_bytes"],
        allocated_bytes=result["allocated_bytes"],
        ranges=tuple((begin, end) for begin, end in result["ranges"]),
        range_sha256=tuple(result["range_sha256"]),
        holes_checked=result["holes_checked"],
        seconds=result["seconds"],
    )
