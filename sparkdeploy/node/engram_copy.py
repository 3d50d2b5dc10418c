"""The Engram sparse copies of one node, as they run ON the node (standard library + shipped
modules: sparkdeploy.remote.node_script ships every module this one imports).

sparkdeploy.steps.stage_engram ships this module and calls `main([request_json])` once per node
for all its shards. It prints JSON lines on stdout as it goes: {"plan": ...} once every shard is
checked, {"progress": ...} while a copy runs, {"result": ...} per shard, and {"ok": true} last;
a deliberate failure (a StagingError) ends with {"ok": false, "kind": ..., "message": ...,
"dest": ...} and exit status FAILED_EXIT. A request with "dry_run": true (a preview) writes
nothing: `preview_all` prints one {"preview": ...} line per shard saying what stage_all would
do, then {"ok": true}.

Every shard is checked before anything is copied (sparkdeploy.node.engram_plan: source, header,
geometry; a DEST already there compared and adopted, sparkdeploy.node.engram_adopt; free space
for all the copies together). Then each copy is made, verified and put in place
(sparkdeploy.node.sparse_copy), or finished where an interrupted one stopped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sparkdeploy.errors import StagingError
from sparkdeploy.node.engram_adopt import adopt, preview_adoption
from sparkdeploy.node.engram_plan import (
    CopyPlan,
    Progress,
    Request,
    check_space,
    find_reusable,
    plan_copy,
    resume_point,
)
from sparkdeploy.node.sparse_copy import copy_sparse
from sparkdeploy.node.staged_file import FAILED_EXIT, about, emit, failure_answer

# What a copy's "no_space" failure tells the operator, after the file and the OS's words.
DISK_FILLED = (
    "the disk filled up during the copy; free space there or move the recipe's "
    "[[composed_model.local_files]] host path to a bigger disk (a re-run resumes from what is "
    "durable)"
)

Emit = Callable[[dict[str, Any]], None]


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
        with about(request.dest, DISK_FILLED):
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
            with about(dest, DISK_FILLED):
                result = stage(item.plan, item.resume_from, progress_of(dest, "copy"))
        emit({"result": dataclasses.asdict(result)})


def preview_all(requests: Sequence[Request], emit: Emit) -> None:
    """What stage_all would do with each shard, from the same checks, writing nothing: one
    {"preview": {"dest", "action", "bytes", "why"}} line per shard. action: "skip" (a verified
    copy is there), "adopt" (DEST matches the source where the dry run looks: stage_all compares
    the ranges, `bytes`, and adopts it unless a byte differs),
    "copy" or "resume" (`bytes` to write), "refuse" (what stage_all would fail with). An
    "adopt" is judged on DEST's size, header, extents and both ends of each range
    (engram_adopt.preview_adoption), not on every byte: a difference inside a range makes
    stage_all copy."""
    previews: list[dict[str, Any]] = []
    pending: list[tuple[CopyPlan, int]] = []
    for request in requests:
        try:
            with about(request.dest, DISK_FILLED):
                plan = plan_copy(request)
                action, count, why, resume_from = _preview_shard(plan)
        except StagingError as failure:
            action, count, why = "refuse", 0, f"[{failure.kind}] {failure}"
        else:
            if action in ("copy", "resume"):
                pending.append((plan, resume_from))
        previews.append({"dest": request.dest, "action": action, "bytes": count, "why": why})
    try:
        check_space(pending)
    except StagingError as failure:
        for preview in previews:
            if preview["action"] in ("copy", "resume"):
                preview.update(action="refuse", why=f"[{failure.kind}] {failure}")
    for preview in previews:
        emit({"preview": preview})


def _preview_shard(plan: CopyPlan) -> tuple[str, int, str, int]:
    """(action, bytes, why, bytes already durable) of one checked shard, as stage_all and adopt
    would decide, reading only."""
    dest = plan.request.dest
    if find_reusable(plan) is not None:
        return "skip", 0, "a verified copy for this plan is there (its manifest matches)", 0
    try:
        before = os.stat(dest)
    except FileNotFoundError:
        before = None
    replaced = ""
    if before is not None:
        verdict, why = preview_adoption(plan, before)
        if verdict == "adopt":
            return "adopt", plan.copy_bytes, why, 0
        if verdict == "refuse":
            return "refuse", 0, why, 0
        replaced = f"; replaces {dest} ({why})"
    resume_from = resume_point(plan)
    if resume_from:
        left = plan.copy_bytes - resume_from
        why = f"resumes the copy at byte {resume_from} of {plan.copy_bytes}{replaced}"
        return "resume", left, why, resume_from
    return "copy", plan.copy_bytes, f"sparse copy of {plan.copy_bytes} B{replaced}", 0


def stage(plan: CopyPlan, resume_from: int, progress: Progress) -> StagingResult:
    """Copy, verify and put in place one checked plan (resume_from bytes already durable)."""
    started = time.monotonic()
    manifest, copied = copy_sparse(plan, resume_from, progress)
    status = "resumed" if resume_from else "copied"
    seconds = round(time.monotonic() - started, 3)
    return _result(plan, status, manifest, copied=copied, seconds=seconds)


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


def main(argv: Sequence[str]) -> int:
    (request_json,) = argv
    node = json.loads(request_json)
    requests = [Request.from_json(node, stage) for stage in node["stages"]]
    try:
        (preview_all if node.get("dry_run") else stage_all)(requests, emit)
    except StagingError as failure:
        emit(failure_answer(failure))
        return FAILED_EXIT
    except OSError as exc:
        message = f"{exc.filename or 'staging'}: {exc.strerror or exc}"
        emit({"ok": False, "kind": "io", "message": message, "dest": None})
        return FAILED_EXIT
    emit({"ok": True})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
