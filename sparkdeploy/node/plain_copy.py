"""Plain local files of one node, as they are put in place ON the node (standard library +
shipped modules: sparkdeploy.remote.node_script ships every module this one imports).

A plain local file (a patched config.json, a tokenizer, a chat template: anything that is not
an Engram table) is put whole at its host path. sparkdeploy.steps.stage_plain ships this module
and calls `main([request_json])` once per node for all its plain files; it prints one JSON
answer on stdout: {"ok": true, "results": [...], "need": [...]} or, for a deliberate failure (a
StagingError), {"ok": false, "kind": ..., "message": ..., "dest": ...} with exit status
FAILED_EXIT.

Each file comes from one of two places:
- the NAS: the file of that name in a repo's snapshot in the NAS HF cache, which the node reads
  through its own mount (`repo` in the request);
- the ops host: the bytes the flow host sends on stdin after the script (`sha256` and `size` in
  the request, taken from the file at plan time). The host first asks without them; a file
  that needs writing is answered as "need", and the host sends its bytes in a second call, so
  a file already in place never crosses the network again.

DEST is checked first, without writing anything:
- skipped: DEST.manifest.json records this source and DEST's size and mtime, so DEST is trusted
  without rehashing;
- adopted: DEST's sha256 equals the source's: the manifest is written beside it and DEST is not
  touched (same inode and mtime, its other hard links stay on it);
- refused (linked_mismatch): DEST differs and other paths hard-link it (other lanes may read
  it), other than this deployment's composed dir (compose-model relinks those): it is never
  rewritten in place, nor replaced under the other links;
- otherwise it is written: to DEST.partial, fsynced, read back and its sha256 checked against
  the source's, then renamed over DEST, and the manifest written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import IO, Any

from sparkdeploy.errors import StagingError
from sparkdeploy.node.hfcache import SnapshotNotFound, resolve_snapshot
from sparkdeploy.node.staged_file import (
    FAILED_EXIT,
    MANIFEST_SUFFIX,
    PARTIAL_SUFFIX,
    about,
    emit,
    failure_answer,
    fsync_dir,
    read_json,
    remove,
    same_inode_under,
    still_describes,
    write_json,
)

FORMAT_VERSION = 1
CHUNK_BYTES = 4 * 1024 * 1024
# What a "no_space" failure tells the operator, after the file and the OS's words.
DISK_FULL = (
    "the disk is full; free space there or move the recipe's [[composed_model.local_files]] "
    "host path to a bigger disk"
)


@dataclass(frozen=True)
class PlainFile:
    """One plain file of a node's request: the plan's PlainStage (sparkdeploy.spec.plan) as it
    arrives here."""

    dest: str
    filename: str
    repo: str | None  # from the NAS snapshot of repo@revision, else from the ops host
    revision: str | None
    sha256: str | None  # the ops host file's, read at plan time
    size: int | None
    inline: bool  # its bytes follow on stdin, in the request's order

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlainFile:
        repo = data.get("repo")
        return cls(
            dest=data["dest"],
            filename=data["filename"],
            repo=repo["repo"] if repo else None,
            revision=repo.get("revision") if repo else None,
            sha256=data.get("sha256"),
            size=data.get("size"),
            inline=bool(data.get("inline")),
        )


@dataclass(frozen=True)
class PlainResult:
    """One plain file in place, as the node reports it and the flow reads it."""

    node: str
    status: str  # "copied", "adopted" or "skipped"
    dest: str
    source: str
    size: int
    sha256: str
    written_bytes: int
    seconds: float

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlainResult:
        return cls(**data)


@dataclass(frozen=True)
class Source:
    """Where a file's bytes come from, and what a manifest must match to trust DEST."""

    description: str
    path: str | None  # the NAS file (resolved through the snapshot), None for the ops host
    size: int
    sha256: str | None  # known up front for the ops host; a NAS file is hashed when needed
    key: dict[str, Any]


def resolve_source(nas_hf_cache: str, plain: PlainFile) -> Source:
    if plain.repo is None:
        if plain.sha256 is None or plain.size is None:
            raise StagingError(
                f"{plain.dest}: no NAS repo and no ops host sha256",
                kind="bad_request",
                dest=plain.dest,
            )
        key = {"ops_host": {"sha256": plain.sha256, "size": plain.size}}
        return Source("the ops host's copy", None, plain.size, plain.sha256, key)
    try:
        commit, snapshot = resolve_snapshot(nas_hf_cache, plain.repo, plain.revision)
    except SnapshotNotFound as exc:
        raise StagingError(str(exc), kind="missing_source", dest=plain.dest) from None
    entry = os.path.join(snapshot, plain.filename)
    path = os.path.realpath(entry)
    if not os.path.isfile(path):
        raise StagingError(
            f"{entry} is missing from {plain.repo}@{commit} in the NAS HF cache (or its blob is "
            "gone); check the recipe's local_files name, or run the prefetch step for this repo",
            kind="missing_source",
            dest=plain.dest,
        )
    stat = os.stat(path)
    identity = {
        "repo": plain.repo,
        "revision": plain.revision,
        "commit": commit,
        "filename": plain.filename,
        "path": path,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }
    return Source(entry, path, stat.st_size, None, {"nas": identity})


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def trusted(dest: str, source: Source) -> dict[str, Any] | None:
    """The manifest of a DEST put (or adopted) for this very source, whose size and mtime are
    still those recorded: DEST is trusted without rehashing."""
    manifest = read_json(dest + MANIFEST_SUFFIX)
    if manifest is None or manifest.get("format_version") != FORMAT_VERSION:
        return None
    if manifest.get("source") != source.key:
        return None
    return manifest if still_describes(manifest, dest) else None


def _write_manifest(dest: str, source: Source, sha256: str) -> None:
    stat = os.stat(dest)
    write_json(
        dest + MANIFEST_SUFFIX,
        {
            "format_version": FORMAT_VERSION,
            "kind": "plain",
            "source": source.key,
            "sha256": sha256,
            "dest": {"path": dest, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns},
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    )


def links_elsewhere(dest: str, stat: os.stat_result, composed_root: str | None) -> int:
    """DEST's hard links other than itself and those in this deployment's composed dir (the
    compose-model step relinks those to the new file)."""
    own = same_inode_under(composed_root, stat) if composed_root is not None else []
    return stat.st_nlink - 1 - len(own)


def check_existing(
    node: str, plain: PlainFile, source: Source, composed_root: str | None
) -> tuple[str, str] | None:
    """(status, sha256) when DEST needs no write: "skipped" (its manifest is trusted) or
    "adopted" (equal bytes; the manifest is written). None when DEST is to be written;
    linked_mismatch when it differs and other paths hard-link it."""
    dest = plain.dest
    manifest = trusted(dest, source)
    if manifest is not None:
        return "skipped", str(manifest["sha256"])
    try:
        before = os.stat(dest)
    except FileNotFoundError:
        return None
    expected = source.sha256 or file_sha256(str(source.path))
    mismatch = (
        f"it is {before.st_size} bytes, {source.description} {source.size}"
        if before.st_size != source.size
        else None
    )
    if mismatch is None and file_sha256(dest) != expected:
        mismatch = f"its sha256 differs from {source.description}'s ({expected[:12]}...)"
    if mismatch is None:
        after = os.stat(dest)
        if (after.st_ino, after.st_mtime_ns) != (before.st_ino, before.st_mtime_ns):
            raise StagingError(
                f"{dest} changed while it was hashed; another process writes it: stop it, "
                "then run the step again",
                kind="io",
                dest=dest,
            )
        _write_manifest(dest, source, expected)
        remove(dest + PARTIAL_SUFFIX)
        return "adopted", expected
    others = links_elsewhere(dest, before, composed_root)
    if others > 0:
        raise StagingError(
            f"node {node}: {dest} differs from {source.description} ({mismatch}) and has "
            f"{before.st_nlink} hard links ({others} outside this deployment's composed dir): "
            "other lanes may read it, so it is neither rewritten in place nor replaced under "
            f"them; check what the other lanes need, then remove or rename {dest} by hand, or "
            "point the recipe's [[composed_model.local_files]] host path at another path",
            kind="linked_mismatch",
            dest=dest,
        )
    return None


def write_verified(plain: PlainFile, source: Source, data: IO[bytes]) -> tuple[str, int]:
    """DEST.partial from `data`, fsynced, read back and checked against the source's sha256,
    renamed over DEST. Returns (sha256, bytes written)."""
    dest = plain.dest
    partial = dest + PARTIAL_SUFFIX
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    digest = hashlib.sha256()
    written = 0
    with open(partial, "wb") as out:
        while written < source.size:
            chunk = data.read(min(CHUNK_BYTES, source.size - written))
            if not chunk:
                break
            out.write(chunk)
            digest.update(chunk)
            written += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    # A NAS source is hashed as it is read; the ops host's bytes against the plan's sha256.
    expected = source.sha256 or digest.hexdigest()
    if written != source.size:
        remove(partial)
        raise StagingError(
            f"{source.description} ended after {written} of {source.size} bytes; it changed "
            "since the plan was made: run the step again",
            kind="io",
            dest=dest,
        )
    # Read back from the file, not the bytes sent: what the disk holds is what is checked.
    read_back = file_sha256(partial)
    if read_back != expected:
        remove(partial)
        raise StagingError(
            f"{partial} hashes to {read_back[:12]}..., {source.description} to {expected[:12]}..."
            "; the file on the ops host changed since the plan, or the local disk is failing: "
            "run the step again (the plan reads the file afresh)",
            kind="verify_failed",
            dest=dest,
        )
    os.replace(partial, dest)
    _write_manifest(dest, source, expected)
    fsync_dir(os.path.dirname(dest))
    return expected, written


def stage_all(
    node: str,
    nas_hf_cache: str,
    composed_root: str | None,
    files: Sequence[PlainFile],
    stdin: IO[bytes],
) -> tuple[list[PlainResult], list[str]]:
    """Every file in place; returns (results, dests of ops host files still to be sent)."""
    results: list[PlainResult] = []
    need: list[str] = []
    for plain in files:
        started = time.monotonic()
        with about(plain.dest, DISK_FULL):
            source = resolve_source(nas_hf_cache, plain)
            found = check_existing(node, plain, source, composed_root)
            if found is not None:
                status, sha256 = found
                written = 0
            elif source.path is None and not plain.inline:
                need.append(plain.dest)
                continue
            elif source.path is None:
                sha256, written = write_verified(plain, source, stdin)
                status = "copied"
            else:
                with open(source.path, "rb") as nas_file:
                    sha256, written = write_verified(plain, source, nas_file)
                status = "copied"
        if plain.inline and written == 0:
            # Sent but not needed (put in place between the two calls): its bytes are skipped.
            stdin.read(source.size)
        results.append(
            PlainResult(
                node=node,
                status=status,
                dest=plain.dest,
                source=source.path or "ops host",
                size=source.size,
                sha256=sha256,
                written_bytes=written,
                seconds=round(time.monotonic() - started, 3),
            )
        )
    return results, need


def main(argv: Sequence[str]) -> int:
    (request_json,) = argv
    request = json.loads(request_json)
    files = [PlainFile.from_json(item) for item in request["files"]]
    try:
        results, need = stage_all(
            request["node"],
            request["nas_hf_cache"],
            request.get("composed_root"),
            files,
            sys.stdin.buffer,
        )
    except StagingError as failure:
        emit(failure_answer(failure))
        return FAILED_EXIT
    emit({"ok": True, "results": [asdict(result) for result in results], "need": need})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
