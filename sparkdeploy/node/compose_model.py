"""The composed model dir, as it is built ON a node (standard library + sparkdeploy.node.hfcache).

sparkdeploy.steps.compose_model ships this module (see sparkdeploy.remote.node_script) and calls
`main([request_json])`; it prints one JSON result line on stdout, and a deliberate failure exits
FAILED_EXIT with {"ok": false, "kind": ..., "message": ...}.

The dir is an HF cache: per source repo `refs/main` (and `refs/<pinned revision>`) and
`snapshots/<sha>/`, whose entries are absolute symlinks to the same entries of the NAS snapshot
(the NAS is mounted at its own path in the container too), except that each local file is
hardlinked in place of the top-level entry of the same name (a hardlink, not a symlink: the
container sees the node-local file through the composed mount alone). It is built in a temporary
dir beside the root and swapped in by one rename; a content key stored in it (sources, their
snapshot shas and entries, the local files' inode/size/mtime) lets an unchanged composition be
left alone.

The key lives in the root's CACHEDIR.TAG (the Cache Directory Tagging Specification,
https://bford.info/cachedir/: a signature line, then free text). huggingface_hub's cache scanner
skips that one name (huggingface_hub/utils/_cache_manager.py, scan_cache_dir), so `hf cache`
commands on a node read the composed dir as a clean cache, and backup tools skip a dir that is
rebuilt from the NAS anyway.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sparkdeploy.node.hfcache import SnapshotNotFound, repo_dir, resolve_snapshot

FORMAT_VERSION = 2
FAILED_EXIT = 3
KEY_FILE = "CACHEDIR.TAG"
CACHEDIR_SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55"
KEY_LINE_PREFIX = "# sparkdeploy-key: "
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


class ComposeFailure(Exception):
    """A deliberate failure: `kind` tells the host which case it is, the message the fix."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Source:
    repo: str
    revision: str | None
    commit: str
    snapshot: str
    entries: tuple[str, ...]  # paths relative to the snapshot, files and file symlinks


def compose(
    root: str,
    nas_hf_cache: str,
    sources: Sequence[dict[str, Any]],
    local_files: Sequence[str],
) -> dict[str, Any]:
    """Build, rebuild or leave alone the composed HF cache at root; returns a summary."""
    resolved = [_resolve(nas_hf_cache, spec["repo"], spec.get("revision")) for spec in sources]
    locals_by_name = {os.path.basename(path): path for path in local_files}
    replaced = _replacements(root, resolved, local_files)
    local_stats = {path: _stat_local(path, replaced[path][0]) for path in local_files}
    key = {
        "format_version": FORMAT_VERSION,
        "nas_hf_cache": nas_hf_cache,
        "sources": [
            {
                "repo": source.repo,
                "revision": source.revision,
                "commit": source.commit,
                "entries_sha256": hashlib.sha256("\n".join(source.entries).encode()).hexdigest(),
            }
            for source in resolved
        ],
        "local_files": [
            {
                "path": path,
                "device": stat.st_dev,
                "inode": stat.st_ino,
                "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns,
            }
            for path, stat in local_stats.items()
        ],
    }
    summary = {
        "root": root,
        "sources": [
            {"repo": s.repo, "commit": s.commit, "entries": len(s.entries)} for s in resolved
        ],
        "hardlinks": {path: replaced[path] for path in local_files},
    }
    existing = read_key(root)
    if existing == key:
        return {"status": "unchanged", **summary}
    if existing is None and os.path.isdir(root) and os.listdir(root):
        raise ComposeFailure(
            "foreign_dir",
            f"{root} exists, is not empty and was not built by sparkdeploy (no {KEY_FILE} with"
            " its key); move it away or point the cluster's composed_root elsewhere",
        )
    parent = os.path.dirname(os.path.abspath(root))
    os.makedirs(parent, exist_ok=True)
    _remove_leftovers(parent, os.path.basename(root))
    building = os.path.join(parent, f".{os.path.basename(root)}.building-{os.getpid()}")
    try:
        for source in resolved:
            _build_repo(building, source)
        for name, local in locals_by_name.items():
            for source in resolved:
                if name in source.entries:
                    _hardlink(
                        local,
                        os.path.join(_snapshot_dir(building, source), name),
                        os.path.join(_snapshot_dir(root, source), name),
                    )
        with open(os.path.join(building, KEY_FILE), "w", encoding="utf-8") as key_file:
            key_file.write(
                f"{CACHEDIR_SIGNATURE}\n"
                "# A model cache composed by sparkdeploy from the NAS; it is rebuilt on demand.\n"
                "# For information about cache directory tags see https://bford.info/cachedir/\n"
                f"{KEY_LINE_PREFIX}{json.dumps(key, sort_keys=True)}\n"
            )
        status = _swap_in(building, root)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return {"status": status, **summary}


def _resolve(nas_hf_cache: str, repo: str, revision: str | None) -> Source:
    try:
        commit, snapshot = resolve_snapshot(nas_hf_cache, repo, revision)
    except SnapshotNotFound as exc:
        raise ComposeFailure("missing_source", str(exc)) from None
    entries: list[str] = []
    for directory, subdirs, files in os.walk(snapshot):
        relative = os.path.relpath(directory, snapshot)
        linked_dirs = [d for d in subdirs if os.path.islink(os.path.join(directory, d))]
        subdirs[:] = sorted(d for d in subdirs if d not in linked_dirs)
        entries.extend(
            os.path.normpath(os.path.join(relative, name)) for name in (*files, *linked_dirs)
        )
    return Source(repo, revision, commit, snapshot, tuple(sorted(entries)))


def _replacements(
    root: str, sources: Sequence[Source], local_files: Sequence[str]
) -> dict[str, list[str]]:
    """For each local file, the composed entry paths (one per source that has it) it replaces."""
    replaced: dict[str, list[str]] = {}
    for local in local_files:
        name = os.path.basename(local)
        targets = [os.path.join(_snapshot_dir(root, s), name) for s in sources if name in s.entries]
        if not targets:
            repos = ", ".join(f"{s.repo}@{s.commit}" for s in sources)
            raise ComposeFailure(
                "unmatched_local",
                f"local file {local}: no source snapshot ({repos}) has an entry named {name}, "
                "so it would replace nothing; fix the recipe's composed_model.local_files or "
                "sources",
            )
        replaced[local] = targets
    return replaced


def _stat_local(path: str, entry: str) -> os.stat_result:
    try:
        return os.stat(path)
    except FileNotFoundError:
        raise ComposeFailure(
            "missing_local",
            f"local file {path} (to be hardlinked as {entry}) does not exist on this node; run "
            "the Engram staging step for this node first, or fix the recipe's local_files path",
        ) from None


def _snapshot_dir(base: str, source: Source) -> str:
    return os.path.join(repo_dir(base, source.repo), "snapshots", source.commit)


def _build_repo(building: str, source: Source) -> None:
    base = repo_dir(building, source.repo)
    refs = {"main"}
    if source.revision and source.revision != source.commit:
        refs.add(source.revision)
    for ref in refs:
        ref_path = os.path.join(base, "refs", ref)
        os.makedirs(os.path.dirname(ref_path), exist_ok=True)
        with open(ref_path, "w", encoding="ascii") as ref_file:
            ref_file.write(source.commit)
    snapshot = os.path.join(base, "snapshots", source.commit)
    os.makedirs(snapshot)
    for entry in source.entries:
        link = os.path.join(snapshot, entry)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.join(source.snapshot, entry), link)


def _hardlink(local: str, entry: str, final_entry: str) -> None:
    """Replace the symlink at entry (in the dir being built; final_entry once swapped in)."""
    os.remove(entry)
    try:
        os.link(local, entry)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        raise ComposeFailure(
            "exdev",
            f"cannot hardlink {local} into the composed dir as {final_entry}: they are on "
            "different mounts (EXDEV), and a hardlink cannot cross mounts even on one disk; "
            "put the recipe's [[composed_model.local_files]] host path and the inventory's"
            " node_paths.composed_root on one filesystem and one mount",
        ) from None


def read_key(root: str) -> dict[str, Any] | None:
    """The content key of the composed dir at root; None when it is no dir of ours (the prune
    reads the local files and source commits a dir links from it)."""
    try:
        with open(os.path.join(root, KEY_FILE), encoding="utf-8") as key_file:
            lines = key_file.read().splitlines()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
    if not lines or lines[0] != CACHEDIR_SIGNATURE:
        return None
    for line in lines[1:]:
        if line.startswith(KEY_LINE_PREFIX):
            try:
                data = json.loads(line[len(KEY_LINE_PREFIX) :])
            except json.JSONDecodeError:
                return None
            return data if isinstance(data, dict) else None
    return None


def _remove_leftovers(parent: str, name: str) -> None:
    """Temporary dirs of runs that died before their cleanup."""
    for leftover in os.listdir(parent):
        if leftover.startswith((f".{name}.building-", f".{name}.old-")):
            shutil.rmtree(os.path.join(parent, leftover), ignore_errors=True)


def _swap_in(building: str, root: str) -> str:
    """Put `building` at `root` in one step; the old root ends up at `building` (to delete)."""
    if not os.path.lexists(root):
        os.rename(building, root)
        return "built"
    if not _exchange(building, root):
        # No renameat2 here (old libc or a filesystem without RENAME_EXCHANGE): two renames.
        old = building.replace(".building-", ".old-")
        os.rename(root, old)
        os.rename(building, root)
        shutil.rmtree(old, ignore_errors=True)
    return "rebuilt"


def _exchange(first: str, second: str) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    status = renameat2(
        _AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE
    )
    if status == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS):
        return False
    raise OSError(error, os.strerror(error), second)


def main(argv: Sequence[str]) -> int:
    (request_json,) = argv
    request = json.loads(request_json)
    try:
        result = compose(
            request["root"], request["nas_hf_cache"], request["sources"], request["local_files"]
        )
    except ComposeFailure as failure:
        print(json.dumps({"ok": False, "kind": failure.kind, "message": str(failure)}))
        return FAILED_EXIT
    except OSError as exc:
        message = f"{exc.filename or request['root']}: {exc.strerror or exc}"
        print(json.dumps({"ok": False, "kind": "io", "message": message}))
        return FAILED_EXIT
    print(json.dumps({"ok": True, "result": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
