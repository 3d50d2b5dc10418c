"""What each deployment takes on a node's disk, measured ON the node (standard library +
sparkdeploy.node.compose_model and sparkdeploy.node.prune; shipped by
sparkdeploy.remote.node_script).

sparkdeploy.steps.status calls `main([request_json])` with
{"deployments": {deployment_id: {"root": composed dir, "local_files": [...]}}}; it prints one
JSON line {"ok": true, "deployments": {deployment_id: {"bytes", "composed", "files"}}}. What a
deployment leaves on a node is what a prune would remove of it (sparkdeploy.node.prune): its
composed dir, and the local files (Engram copies, plain files) the request or the dir's key names,
each with our companions beside it (manifest, partial, journal). Bytes are on disk (st_blocks *
512: a sparse Engram copy's holes take nothing), and each inode counts once: a local file is
hardlinked into the composed dir, and is one copy on the disk. Nothing is followed (a composed
dir's symlinks point into the NAS) and nothing is written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

from sparkdeploy.node.compose_model import read_key
from sparkdeploy.node.prune import COMPANION_SUFFIXES, disk_bytes

FAILED_EXIT = 3


def _entries(root: str) -> Iterator[os.stat_result]:
    """Every entry under root (root itself too), lstat'ed; none when root is absent."""
    try:
        yield os.lstat(root)
    except (FileNotFoundError, NotADirectoryError):
        return
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            try:
                yield os.lstat(os.path.join(directory, name))
            except FileNotFoundError:
                continue


def _with_companions(path: str) -> Iterator[os.stat_result]:
    for candidate in (path, *(path + suffix for suffix in COMPANION_SUFFIXES)):
        try:
            yield os.lstat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            continue


def measure(root: str, local_files: Sequence[str]) -> dict[str, Any]:
    """One deployment's composed dir and local files: bytes on disk (each inode once), whether
    the dir exists and how many of the local files do."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def count(st: os.stat_result) -> None:
        nonlocal total
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += disk_bytes(st)

    for st in _entries(root):
        count(st)
    key = read_key(root) or {}
    named = {*local_files, *(entry["path"] for entry in key.get("local_files", []))}
    found = 0
    for path in sorted(named):
        found += os.path.lexists(path)
        for st in _with_companions(path):
            count(st)
    return {"bytes": total, "composed": os.path.isdir(root), "files": found}


def main(argv: Sequence[str]) -> int:
    (request_json,) = argv
    request = json.loads(request_json)
    try:
        answer = {
            deployment_id: measure(entry["root"], entry["local_files"])
            for deployment_id, entry in request["deployments"].items()
        }
    except OSError as exc:
        print(json.dumps({"ok": False, "message": f"{exc.filename}: {exc.strerror or exc}"}))
        return FAILED_EXIT
    print(json.dumps({"ok": True, "deployments": answer}))
    return 0
