"""The NAS HF cache: the layout huggingface_hub itself writes and reads offline, and our manifest.

`models--org--name/blobs/<sha256 or git oid>`, `snapshots/<sha>/<path>` as relative symlinks to
the blobs, `refs/<branch>`, and the commit's file list where huggingface_hub keeps it. Beside
that, in `models--org--name/.sparkdeploy/`, a manifest per commit, `<sha>.json`, that records
each verified file's size and the inode and mtime it had when verified. A repo whose manifest
still matches the disk is complete: that check is one stat per file and never reads file data.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub.file_download import repo_folder_name

from sparkdeploy.errors import PrefetchError
from sparkdeploy.remote.hf_tree_cache import TreeFile, write_commit_files
from sparkdeploy.steps.prefetch.hub import HubFile, RepoLike, Verification
from sparkdeploy.steps.prefetch.names import is_commit_sha
from sparkdeploy.steps.prefetch.selection import ENGINE_SELECTION, FileSelection
from sparkdeploy.units import human_bytes

MANIFEST_DIRNAME = ".sparkdeploy"
MANIFEST_VERSION = 1
PARTIAL_SUFFIX = ".incomplete"

# A partial file that is not one of this revision's blobs (another revision's, or one a
# huggingface_hub client named per process) and untouched this long belongs to a download that
# died; we hold the repo lock, so it is safe to remove.
_ABANDONED_PARTIAL_AGE_S = 600.0


@dataclass(frozen=True)
class FileOutcome:
    path: str
    size: int
    verified: Verification
    fetched: bool


@dataclass(frozen=True)
class RepoOutcome:
    repo: str
    revision: str | None
    sha: str
    snapshot_dir: str
    files: tuple[FileOutcome, ...]

    @property
    def fetched_bytes(self) -> int:
        return sum(f.size for f in self.files if f.fetched)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def storage_dir(cache_dir: Path, repo: str) -> Path:
    return cache_dir / repo_folder_name(repo_id=repo, repo_type="model")


def manifest_path(cache_dir: Path, repo: str, sha: str) -> Path:
    return storage_dir(cache_dir, repo) / MANIFEST_DIRNAME / f"{sha}.json"


def complete_outcome(
    cache_dir: Path, ref: RepoLike, sha: str, selection: FileSelection = ENGINE_SELECTION
) -> RepoOutcome | None:
    """The repo's outcome if its manifest, written for the same selection of files, exists and
    every file still has the recorded identity."""
    entries = _read_manifest(cache_dir, ref.repo, sha, selection)
    if entries is None:
        return None
    snapshot = storage_dir(cache_dir, ref.repo) / "snapshots" / sha
    for entry in entries.values():
        if not _identity_matches(snapshot / entry["path"], entry):
            return None
    files = tuple(
        FileOutcome(e["path"], e["size"], e["verified"], fetched=False) for e in entries.values()
    )
    return RepoOutcome(ref.repo, ref.revision, sha, str(snapshot), files)


def still_verified(cache_dir: Path, repo: str, sha: str) -> dict[str, dict[str, Any]]:
    """The manifest's entries, by path, of the files that still have the recorded identity."""
    snapshot = storage_dir(cache_dir, repo) / "snapshots" / sha
    return {
        path: entry
        for path, entry in (_read_manifest(cache_dir, repo, sha) or {}).items()
        if _identity_matches(snapshot / path, entry)
    }


def _read_manifest(
    cache_dir: Path, repo: str, sha: str, selection: FileSelection | None = None
) -> dict[str, dict[str, Any]] | None:
    """The manifest's entries by path (None: no manifest of this version, or, when `selection`
    is given, one written for another selection of files)."""
    try:
        data = json.loads(manifest_path(cache_dir, repo, sha).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if data.get("version") != MANIFEST_VERSION or data.get("sha") != sha:
        return None
    if selection is not None and data.get("selection") != selection.as_json():
        return None
    return {entry["path"]: entry for entry in data["files"]}


def _identity_matches(pointer: Path, entry: dict[str, Any]) -> bool:
    try:
        st = pointer.stat()
    except FileNotFoundError:
        return False
    return bool(
        st.st_size == entry["size"]
        and st.st_ino == entry["ino"]
        and st.st_mtime_ns == entry["mtime_ns"]
    )


def manifest_entry(pointer: Path, f: HubFile) -> dict[str, Any]:
    """What the manifest remembers of a verified file: the identity it has now."""
    st = pointer.stat()
    return {
        "path": f.path,
        "size": f.size,
        "verified": f.verification,
        "digest": f.expected_digest,
        "ino": st.st_ino,
        "mtime_ns": st.st_mtime_ns,
    }


def write_manifest(
    cache_dir: Path,
    repo: str,
    sha: str,
    entries: list[dict[str, Any]],
    selection: FileSelection = ENGINE_SELECTION,
) -> None:
    path = manifest_path(cache_dir, repo, sha)
    payload = {
        "version": MANIFEST_VERSION,
        "repo": repo,
        "sha": sha,
        "selection": selection.as_json(),
        "files": entries,
    }
    _atomic_write(path, json.dumps(payload, indent=1, sort_keys=True))


def missing_bytes(cache_dir: Path, repo: str, sha: str, files: list[HubFile]) -> int:
    snapshot = storage_dir(cache_dir, repo) / "snapshots" / sha
    missing = 0
    for f in files:
        try:
            present = (snapshot / f.path).stat().st_size == f.size
        except FileNotFoundError:
            present = False
        missing += 0 if present else f.size
    return missing


def check_free_space(cache_dir: Path, missing_bytes: dict[str, int]) -> None:
    needed = sum(missing_bytes.values())
    free = shutil.disk_usage(cache_dir).free
    if needed > free:
        detail = ", ".join(f"{repo} {human_bytes(n)}" for repo, n in missing_bytes.items() if n)
        raise PrefetchError(
            f"NAS HF cache {cache_dir} has {human_bytes(free)} ({free} bytes) free but the "
            f"prefetch needs {human_bytes(needed)} ({needed} bytes) more: {detail}. Free space on "
            "the NAS (e.g. `hf cache rm` old revisions) or prefetch fewer repos"
        )


def link(pointer: Path, blob: Path) -> None:
    """Point the snapshot entry at the blob with a relative symlink, as huggingface_hub does."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    tmp = pointer.with_name(f".{pointer.name}.{os.getpid()}.{threading.get_ident()}.link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(os.path.relpath(blob, pointer.parent))
    os.replace(tmp, pointer)


def remove_file(pointer: Path) -> None:
    """Remove a snapshot entry and, when it is a symlink, the blob it points to."""
    if pointer.is_symlink():
        pointer.resolve().unlink(missing_ok=True)
    pointer.unlink(missing_ok=True)


def remove_abandoned_partials(blobs: Path, keep: set[str]) -> None:
    """Remove old partial files except this revision's own, which the download resumes."""
    if not blobs.is_dir():
        return
    now = time.time()
    for partial in blobs.glob(f"*{PARTIAL_SUFFIX}"):
        if partial.name.removesuffix(PARTIAL_SUFFIX) in keep:
            continue
        with contextlib.suppress(FileNotFoundError):
            if now - partial.stat().st_mtime > _ABANDONED_PARTIAL_AGE_S:
                partial.unlink()


def write_tree_cache(storage: Path, sha: str, files: Sequence[HubFile]) -> None:
    """Record the commit's file list where huggingface_hub keeps it: what its own
    snapshot_download would have left."""
    write_commit_files(
        storage,
        sha,
        {f.path: TreeFile(size=f.size, blob_id=f.blob_id, lfs_sha256=f.lfs_sha256) for f in files},
    )


def read_ref(cache_dir: Path, ref: RepoLike) -> str | None:
    """The commit refs/<branch> names in the cache for a branch or tag (None: not there)."""
    path = storage_dir(cache_dir, ref.repo) / "refs" / (ref.revision or "main")
    try:
        sha = path.read_text().strip()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    return sha if is_commit_sha(sha) else None


def write_ref(cache_dir: Path, ref: RepoLike, sha: str) -> None:
    """Point refs/<branch> at `sha`: offline engines resolve an unpinned repo through it."""
    revision = ref.revision or "main"
    if revision == sha:
        return
    path = storage_dir(cache_dir, ref.repo) / "refs" / revision
    with contextlib.suppress(FileNotFoundError):
        if path.read_text() == sha:
            return
    _atomic_write(path, sha)


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
