"""The repos on disk as the hub serves them: each file's size and digests (cached while the file
is unchanged), the revision's commit sha, the gate's tokens."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".onnx")
LFS_MIN_BYTES = 10 * 1024 * 1024
CACHE_DIR_NAME = ".hub-cache"  # under repos_dir; org names never start with a dot
HASH_CHUNK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class HubFile:
    """One file of a repo as the hub describes it."""

    path: str
    size: int
    blob_id: str  # git blob sha1 (of the LFS pointer for LFS files)
    sha256: str | None  # LFS files only

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id

    def lfs_pointer(self) -> bytes:
        return (
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\n"
            f"size {self.size}\n"
        ).encode()

    def tree_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "type": "file",
            "oid": self.blob_id,
            "size": self.size,
            "path": self.path,
        }
        if self.sha256 is not None:
            entry["lfs"] = {
                "oid": self.sha256,
                "size": self.size,
                "pointerSize": len(self.lfs_pointer()),
            }
        return entry

    def sibling(self) -> dict[str, Any]:
        sibling: dict[str, Any] = {
            "rfilename": self.path,
            "size": self.size,
            "blobId": self.blob_id,
        }
        if self.sha256 is not None:
            sibling["lfs"] = {
                "size": self.size,
                "sha256": self.sha256,
                "pointerSize": len(self.lfs_pointer()),
            }
        return sibling


@dataclass(frozen=True)
class RepoState:
    """A repo's single revision: its commit sha and files, sorted by path."""

    repo_id: str
    root: Path
    sha: str
    files: dict[str, HubFile]
    last_modified: float
    gated_tokens: frozenset[str] | None

    def directories(self) -> list[str]:
        """Every directory that holds a file, at any depth."""
        found: set[str] = set()
        for path in self.files:
            parts = path.split("/")[:-1]
            found.update("/".join(parts[: depth + 1]) for depth in range(len(parts)))
        return sorted(found)


def is_lfs(path: str, size: int) -> bool:
    return path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_BYTES


class RepoIndex:
    """Repo states with the files' digests cached (memory and repos_dir/.hub-cache).

    A digest is reused while the file's size, mtime and inode are unchanged, so a multi-GiB
    repo is hashed once, not on every request.
    """

    def __init__(self, repos_dir: Path) -> None:
        self.repos_dir = repos_dir
        self._lock = threading.Lock()
        self._repo_locks: dict[str, threading.Lock] = {}

    def state(
        self, repo_id: str, known_sha256: Mapping[str, str] | None = None
    ) -> RepoState | None:
        """The repo's state now, or None if there is no such repo.

        known_sha256 gives the sha256 of LFS files by path, from whoever just wrote them, so
        they need not be read again.
        """
        org, _, name = repo_id.partition("/")
        if not org or not name or org.startswith(".") or name.startswith(".") or "/" in name:
            return None
        root = self.repos_dir / org / name
        if not root.is_dir():
            return None
        with self._lock:
            repo_lock = self._repo_locks.setdefault(repo_id, threading.Lock())
        with repo_lock:
            return self._build(repo_id, root, known_sha256 or {})

    def _build(self, repo_id: str, root: Path, known_sha256: Mapping[str, str]) -> RepoState:
        cache_path = self.repos_dir / CACHE_DIR_NAME / f"{repo_id}.json"
        cache = _read_json(cache_path)
        files: dict[str, HubFile] = {}
        fresh_cache: dict[str, Any] = {}
        last_modified = 0.0
        for path in sorted(_walk_files(root)):
            relative = path.relative_to(root).as_posix()
            stat = path.stat()
            identity = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
            cached = cache.get(relative)
            if isinstance(cached, dict) and cached.get("identity") == identity:
                entry = cached
            elif relative in known_sha256 and is_lfs(relative, stat.st_size):
                entry = {
                    "identity": identity,
                    **_lfs_digests(relative, stat.st_size, known_sha256[relative]),
                }
            else:
                entry = {"identity": identity, **_digests(path, relative, stat.st_size)}
            fresh_cache[relative] = entry
            files[relative] = HubFile(relative, stat.st_size, entry["blob_id"], entry["sha256"])
            last_modified = max(last_modified, stat.st_mtime)
        if fresh_cache != cache:
            _write_json(cache_path, fresh_cache)
        listing = "".join(f"{f.path}\0{f.etag}\0" for f in files.values())
        sha = hashlib.sha1(f"{repo_id}\0{listing}".encode()).hexdigest()
        gate = root.parent / f"{root.name}.gated"
        gated_tokens = (
            frozenset(line.strip() for line in gate.read_text().splitlines() if line.strip())
            if gate.is_file()
            else None
        )
        return RepoState(repo_id, root, sha, files, last_modified, gated_tokens)


def _walk_files(root: Path) -> Iterator[Path]:
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d != ".git"]
        for name in names:
            yield Path(directory) / name


def _digests(path: Path, relative: str, size: int) -> dict[str, Any]:
    lfs = is_lfs(relative, size)
    digest = hashlib.sha256() if lfs else hashlib.sha1(f"blob {size}\0".encode())
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    if not lfs:
        return {"blob_id": digest.hexdigest(), "sha256": None}
    return _lfs_digests(relative, size, digest.hexdigest())


def _lfs_digests(relative: str, size: int, sha256: str) -> dict[str, Any]:
    pointer = HubFile(relative, size, "", sha256).lfs_pointer()
    blob_id = hashlib.sha1(f"blob {len(pointer)}\0".encode() + pointer).hexdigest()
    return {"blob_id": blob_id, "sha256": sha256}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    temporary.write_text(json.dumps(data))
    temporary.replace(path)


def index_repo(
    repos_dir: str | os.PathLike[str],
    repo_id: str,
    known_sha256: Mapping[str, str] | None = None,
) -> RepoState:
    """Put a repo's digests in the hub's cache now, so its first request is fast."""
    state = RepoIndex(Path(repos_dir)).state(repo_id, known_sha256)
    if state is None:
        raise FileNotFoundError(f"no repo {repo_id} under {repos_dir} (expected {repo_id}/ there)")
    return state


def repo_info(state: RepoState, query: Mapping[str, str]) -> dict[str, Any]:
    """The model info /api/models/{repo} answers; siblings with sizes and digests when the query
    asks for blobs."""
    with_blobs = query.get("blobs", "false").lower() == "true"
    modified = datetime.fromtimestamp(state.last_modified, UTC).isoformat().replace("+00:00", "Z")
    org = state.repo_id.split("/")[0]
    return {
        "_id": state.sha[:24],
        "id": state.repo_id,
        "modelId": state.repo_id,
        "author": org,
        "sha": state.sha,
        "lastModified": modified,
        "createdAt": modified,
        "private": False,
        "gated": "manual" if state.gated_tokens is not None else False,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "library_name": "transformers",
        "siblings": [
            f.sibling() if with_blobs else {"rfilename": f.path} for f in state.files.values()
        ],
        "usedStorage": sum(f.size for f in state.files.values()),
    }
