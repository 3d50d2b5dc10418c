"""What deployments left on a node, listed and removed ON the node (standard library +
sparkdeploy.node.compose_model; shipped by sparkdeploy.remote.node_script).

sparkdeploy.steps.prune calls `main([request_json])`; it prints one JSON line, and never runs a
shell: every path comes from the request (or from a composed dir's own key) and is only
stat'ed, listed or unlinked.

- {"action": "list", "composed_root": R, "local_files": [...]}: every dir under R (a composed
  dir is named by its deployment id) with its bytes on disk, its mtime and, from its key, the
  local files it links and the NAS commits it points at; then every local file the request or a
  composed dir's key names, with its bytes on disk (st_blocks * 512: an Engram copy is sparse),
  st_nlink, how many of those links are inside R (a composed dir's own), mtime and whether our
  manifest is beside it. Deciding what goes is the flow host's (sparkdeploy.steps.prune).
- {"action": "remove", "composed_root": R, "items": [...]}: the listed items the flow host chose,
  each removed only while it is still as listed (same inode, size and mtime); composed dirs
  first, since their hard links hold the local files, then each file only when its st_nlink
  has come down to 1: a link another lane made since the listing keeps it.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from typing import Any

from sparkdeploy.node.compose_model import read_key

FAILED_EXIT = 3
# Written beside a local file by sparkdeploy.node.engram_copy and plain_copy (the same names
# as staged_file's and engram_plan's; tests/test_prune.py checks): they go with the file.
MANIFEST_SUFFIX = ".manifest.json"
COMPANION_SUFFIXES = (MANIFEST_SUFFIX, ".partial", ".partial.journal.json")


def disk_bytes(st: os.stat_result) -> int:
    """What a file takes on disk: a sparse Engram copy's holes take nothing."""
    return st.st_blocks * 512


def _walk(root: str) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry under root (root itself too), lstat'ed: symlinks are never followed."""
    yield root, os.lstat(root)
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            path = os.path.join(directory, name)
            try:
                yield path, os.lstat(path)
            except FileNotFoundError:
                continue


def _composed_dir(path: str) -> dict[str, Any]:
    """A dir under the composed root: its own bytes (a file with other links is a local file's
    link, whose bytes are the local file's), the inodes it links, and its key's facts."""
    own = 0
    linked: dict[str, int] = {}
    for _, st in _walk(path):
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            inode = f"{st.st_dev}:{st.st_ino}"
            linked[inode] = linked.get(inode, 0) + 1
        else:
            own += disk_bytes(st)
    key = read_key(path)
    st = os.lstat(path)
    return {
        "name": os.path.basename(path),
        "path": path,
        "bytes": own,
        "mtime": st.st_mtime,
        "mtime_ns": st.st_mtime_ns,
        "ours": key is not None,
        "local_files": [entry["path"] for entry in (key or {}).get("local_files", [])],
        "commits": [
            {"repo": source["repo"], "commit": source["commit"]}
            for source in (key or {}).get("sources", [])
        ],
        "linked": linked,
    }


def _local_file(path: str, composed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return {"path": path, "exists": False}
    if not stat.S_ISREG(st.st_mode):
        return {"path": path, "exists": True, "regular": False}
    inode = f"{st.st_dev}:{st.st_ino}"
    companions = 0
    for suffix in COMPANION_SUFFIXES:
        try:
            companions += disk_bytes(os.lstat(path + suffix))
        except FileNotFoundError:
            continue
    return {
        "path": path,
        "exists": True,
        "regular": True,
        "bytes": disk_bytes(st) + companions,
        "size": st.st_size,
        "ino": st.st_ino,
        "nlink": st.st_nlink,
        "mtime": st.st_mtime,
        "mtime_ns": st.st_mtime_ns,
        "manifest": os.path.exists(path + MANIFEST_SUFFIX),
        # composed dir name -> how many of the file's links are in it
        "linked_from": {
            entry["name"]: entry["linked"][inode] for entry in composed if inode in entry["linked"]
        },
    }


def list_node(composed_root: str, local_files: Sequence[str]) -> dict[str, Any]:
    """The composed dirs under composed_root and the local files named (by the request or by a
    composed dir's key), as the module's docstring says."""
    composed = []
    if os.path.isdir(composed_root):
        for name in sorted(os.listdir(composed_root)):
            path = os.path.join(composed_root, name)
            # Dot entries are a compose in flight (or its leftover, which compose removes).
            if name.startswith(".") or not stat.S_ISDIR(os.lstat(path).st_mode):
                continue
            composed.append(_composed_dir(path))
    paths = sorted({*local_files, *(p for entry in composed for p in entry["local_files"])})
    return {"composed": composed, "files": [_local_file(path, composed) for path in paths]}


def _remove_composed(composed_root: str, item: dict[str, Any]) -> str | None:
    """None once removed, else why it stays."""
    path = item["path"]
    if os.path.dirname(path) != composed_root.rstrip("/") or os.path.basename(path) in (
        "",
        ".",
        "..",
    ):
        return f"not a dir directly under {composed_root}"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "already gone"
    if not stat.S_ISDIR(st.st_mode) or read_key(path) is None:
        return "no longer a composed dir of ours"
    if st.st_mtime_ns != item["mtime_ns"]:
        return "changed since it was listed (a deploy composed it again)"
    shutil.rmtree(path)
    return None


def _remove_file(item: dict[str, Any]) -> str | None:
    """None once removed, else why it stays."""
    path = item["path"]
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "already gone"
    if (st.st_ino, st.st_size, st.st_mtime_ns) != (item["ino"], item["size"], item["mtime_ns"]):
        return "changed since it was listed"
    if st.st_nlink != 1:
        return f"{st.st_nlink - 1} other hard link(s) to it now: another lane holds it"
    os.unlink(path)
    for suffix in COMPANION_SUFFIXES:
        try:
            os.unlink(path + suffix)
        except FileNotFoundError:
            continue
    return None


def remove(composed_root: str, items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each item removed while still as listed: composed dirs first, then files."""
    removed: list[str] = []
    kept: dict[str, str] = {}
    ordered = sorted(items, key=lambda item: item["kind"] != "composed")
    for item in ordered:
        why = (
            _remove_composed(composed_root, item)
            if item["kind"] == "composed"
            else _remove_file(item)
        )
        if why is None:
            removed.append(item["path"])
        else:
            kept[item["path"]] = why
    return {"removed": removed, "kept": kept}


def main(argv: Sequence[str]) -> int:
    (request_json,) = argv
    request = json.loads(request_json)
    try:
        if request["action"] == "list":
            answer = list_node(request["composed_root"], request["local_files"])
        else:
            answer = remove(request["composed_root"], request["items"])
    except OSError as exc:
        print(json.dumps({"ok": False, "message": f"{exc.filename}: {exc.strerror or exc}"}))
        return FAILED_EXIT
    print(json.dumps({"ok": True, **answer}))
    return 0
