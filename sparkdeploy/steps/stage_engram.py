"""Engram sparse-copy staging: run sparkdeploy.node.engram_copy on a node, turn its answer into
data.

One python3 on the node per call, for all the node's shards: it checks them all (source,
header, geometry, an existing file it may adopt, free space), says how many bytes remain to
copy, then copies and verifies each, printing progress as it goes. The lines are read as they
come (stream_lines), so progress reaches the caller live and the deadline is sized from the
bytes left once they are known.
See sparkdeploy.node.engram_copy for the copy itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

from sparkdeploy.errors import RemoteError, StagingError, TransientRemoteError
from sparkdeploy.node import engram_copy, engram_plan
from sparkdeploy.node.engram_copy import StagingResult
from sparkdeploy.remote.node_script import build_node_script, python_argv
from sparkdeploy.remote.runner import STDERR_TAIL_CHARS, Runner
from sparkdeploy.remote.targets import on_plan_nodes
from sparkdeploy.spec.plan import EngramStage, Plan

# The longest the node script may stay silent: while it checks the shards (NAS lookups and
# header reads) and between two progress lines of a copy (one fdatasync of a slow disk).
SILENCE_TIMEOUT_S = 120.0
# The slowest NAS read rate that is still healthy; it sizes the copy's deadline.
MIN_COPY_BYTES_PER_S = 50 * 1000 * 1000
COPY_TIMEOUT_BASE_S = 300.0
# Bounds the stream as a whole; the node must print its plan within SILENCE_TIMEOUT_S, and from
# then on the deadline sized from the plan is checked at every line, so that one ends it first.
STREAM_BACKSTOP_S = 48 * 3600.0

# node, dest, done, total, phase: "copy" (copied and verified) or "compare" (an existing file
# compared with the source to adopt it)
ProgressCallback = Callable[[str, str, int, int, str], None]


@cache
def node_script() -> str:
    return build_node_script(engram_copy)


def node_argv(request: dict[str, Any]) -> list[str]:
    """The node command for one node's request (see engram_plan.Request.from_json)."""
    return python_argv(node_script(), [json.dumps(request)])


def node_request(
    node: str,
    *,
    nas_hf_cache: str,
    stages: Sequence[EngramStage],
    composed_root: str | None = None,
    chunk_bytes: int = engram_plan.DEFAULT_CHUNK_BYTES,
    sync_bytes: int = engram_plan.DEFAULT_SYNC_BYTES,
    stop_after_chunks: int | None = None,
) -> dict[str, Any]:
    """What the node script reads (engram_plan.Request.from_json): the plan's stages as they
    are, serialised once, with what applies to all of them (composed_root: the node's composed
    dir, whose hard links to a copy do not make it shared with other lanes)."""
    return {
        "node": node,
        "nas_hf_cache": nas_hf_cache,
        "composed_root": composed_root,
        "chunk_bytes": chunk_bytes,
        "sync_bytes": sync_bytes,
        "stop_after_chunks": stop_after_chunks,
        "stages": [stage.model_dump(mode="json") for stage in stages],
    }


def stage_on_node(
    runner: Runner,
    node: str,
    *,
    nas_hf_cache: str,
    stages: Sequence[EngramStage],
    composed_root: str | None = None,
    on_progress: ProgressCallback | None = None,
    chunk_bytes: int = engram_plan.DEFAULT_CHUNK_BYTES,
    sync_bytes: int = engram_plan.DEFAULT_SYNC_BYTES,
    stop_after_chunks: int | None = None,
) -> list[StagingResult]:
    """Make (or find, adopt or finish) the verified sparse copy of each of a node's stages.

    stop_after_chunks is fault injection for tests: the
    node stops as if killed after writing that many chunks.
    """
    request = node_request(
        node,
        nas_hf_cache=nas_hf_cache,
        stages=stages,
        composed_root=composed_root,
        chunk_bytes=chunk_bytes,
        sync_bytes=sync_bytes,
        stop_after_chunks=stop_after_chunks,
    )
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
                on_progress(
                    node,
                    progress["dest"],
                    progress["done"],
                    progress["total"],
                    progress.get("phase", "copy"),
                )
        elif "result" in line:
            results.append(StagingResult.from_json(line["result"]))
        elif "ok" in line:
            answer = line
        if deadline is not None and time.monotonic() > deadline:
            stream.close()
            raise RemoteError(
                f"node {node}: staging {_describe(stages)} did not finish by its deadline (the "
                f"bytes left at {MIN_COPY_BYTES_PER_S / 1e6:.0f} MB/s plus "
                f"{COPY_TIMEOUT_BASE_S:.0f} s); the NAS or the local disk is too slow; a re-run "
                "resumes the copy"
            )
    if answer is None:
        tail = "\n".join(other_output)[-STDERR_TAIL_CHARS:]
        if stream.exit_code is None:
            raise TransientRemoteError(
                f"node {node}: the staging script for {_describe(stages)} stopped without an "
                f"answer or exit status (connection lost, or silent for {SILENCE_TIMEOUT_S:.0f} "
                f"s); a re-run resumes the copy; its output ends with: {tail}"
            )
        how = (
            "was killed by a signal (SSH reports exit status -1)"
            if stream.exit_code == -1
            else f"exited {stream.exit_code}"
        )
        raise RemoteError(
            f"node {node}: the staging script for {_describe(stages)} {how} without an answer;"
            f" a re-run resumes the copy; its output ends with: {tail or '(nothing)'}"
        )
    if not answer["ok"]:
        failed = [stage for stage in stages if stage.dest == answer.get("dest")] or stages
        raise StagingError(
            f"node {node}: staging {_describe(failed)} failed [{answer['kind']}]: "
            f"{answer['message']}"
        )
    return results


def stage_engram(
    plan: Plan, *, on_progress: ProgressCallback | None = None
) -> dict[str, list[StagingResult]]:
    """Every node's stages of the plan, all nodes at once; nodes with none are left out."""
    return on_plan_nodes(
        [node for node in plan.nodes if node.engram],
        lambda runner, node: stage_on_node(
            runner,
            node.node,
            nas_hf_cache=plan.nas_hf_cache,
            stages=node.engram,
            composed_root=node.composed_root,
            on_progress=on_progress,
        ),
    )


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        line = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return line if isinstance(line, dict) else None


def _describe(stages: Sequence[EngramStage]) -> str:
    return "; ".join(
        f"{stage.repo.repo}/{stage.filename} to {stage.dest} (ranks {stage.ranks} of TP "
        f"{stage.tp_size})"
        for stage in stages
    )
