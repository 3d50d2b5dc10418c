"""Engram sparse-copy staging: run sparkdeploy.node_staging on a node, turn its answer into data.

Two calls per shard: `inspect` (seconds: resolves the source, parses its header, checks the
geometry and the free space, answers "skipped" if a verified copy is already there) and, unless
it was skipped, `stage` with a timeout sized from the bytes left to copy.
See node_staging for the copy itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

from sparkdeploy import engram, node_hfcache, node_staging
from sparkdeploy.errors import RemoteError, StagingError
from sparkdeploy.node_script import STDERR_TAIL_CHARS, build_node_script, last_json_line

INSPECT_TIMEOUT_S = 120.0
# The slowest NAS read rate that is still healthy; it sizes the copy's timeout.
MIN_COPY_BYTES_PER_S = 50 * 1000 * 1000
COPY_TIMEOUT_BASE_S = 300.0

ProgressCallback = Callable[[str, int, int], None]


class RunResult(Protocol):
    @property
    def exit_code(self) -> int: ...
    @property
    def stdout(self) -> bytes: ...
    @property
    def stderr(self) -> bytes: ...


class PythonRunner(Protocol):
    """What staging needs of a node: sparkdeploy.ssh.Connection has this method."""

    def run_python(
        self,
        source: str,
        args: Sequence[str],
        *,
        timeout: float,
        stdin: bytes | None = None,
        check: bool = True,
    ) -> RunResult: ...


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


def stage_engram(
    runner: PythonRunner,
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
    stop_after_chunks: int | None = None,
) -> StagingResult:
    """Make (or find, or finish) the verified sparse copy of one Engram shard on one node.

    stop_after_chunks is fault injection for tests: the node stops as if killed after writing
    that many chunks.
    """
    request: dict[str, Any] = {
        "nas_hf_cache": nas_hf_cache,
        "repo": repo,
        "revision": revision,
        "filename": filename,
        "dest": dest,
        "ranks": list(ranks),
        "tp_size": tp_size,
        "chunk_bytes": chunk_bytes,
        "stop_after_chunks": stop_after_chunks,
    }
    inspected = _call(runner, node, "inspect", request, INSPECT_TIMEOUT_S, on_progress)
    result = inspected.get("skipped")
    if result is None:
        timeout = COPY_TIMEOUT_BASE_S + inspected["remaining_bytes"] / MIN_COPY_BYTES_PER_S
        result = _call(runner, node, "stage", request, timeout, on_progress)
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


def _call(
    runner: PythonRunner,
    node: str,
    mode: str,
    request: dict[str, Any],
    timeout: float,
    on_progress: ProgressCallback | None,
) -> dict[str, Any]:
    completed = runner.run_python(
        node_script(), [mode, json.dumps(request)], timeout=timeout, check=False
    )
    stderr = completed.stderr.decode("utf-8", "replace")
    if on_progress is not None:
        for done, total in progress_lines(stderr):
            on_progress(node, done, total)
    answer = last_json_line(completed.stdout)
    if answer is None:
        raise RemoteError(
            f"node {node}: the staging script ({mode} {request['dest']}) exited "
            f"{completed.exit_code} without an answer; stderr ends with: "
            f"{stderr[-STDERR_TAIL_CHARS:]}"
        )
    if not answer.get("ok"):
        raise StagingError(
            f"node {node}: staging {request['repo']}/{request['filename']} to {request['dest']} "
            f"(ranks {request['ranks']} of TP {request['tp_size']}) failed "
            f"[{answer.get('kind')}]: {answer.get('message')}"
        )
    result: dict[str, Any] = answer["result"]
    return result


def progress_lines(stderr: str) -> list[tuple[int, int]]:
    """(done, total) of every progress line the node script printed."""
    found = []
    for line in stderr.splitlines():
        if not line.startswith('{"progress"'):
            continue
        try:
            progress = json.loads(line)["progress"]
        except (json.JSONDecodeError, KeyError):
            continue
        found.append((int(progress["done"]), int(progress["total"])))
    return found
