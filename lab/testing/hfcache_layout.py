"""Put a lab.tinymodel repo into an HF cache the way the prefetch step leaves the NAS.

`models--org--name/blobs/<name>` holds the files (hardlinked from the generated repo: no copy),
`snapshots/<commit>/<file>` are relative symlinks to them and `refs/main` names the commit.
Shared by the staging and compose tests and bench/ (engram_staging, adopt, readiness);
`cache_files` lays out a few files given as bytes the same way.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from lab.tinymodel import GeneratedRepo


def commit_of(repo_id: str, revision: str) -> str:
    return hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()


def cache_repo(
    repo: GeneratedRepo, hf_cache: Path, *, revision: str = "1", ref: str = "main"
) -> Path:
    """The snapshot dir of `repo` in `hf_cache`, with refs/<ref> pointing at it."""
    commit = commit_of(repo.repo_id, revision)
    base = hf_cache / ("models--" + repo.repo_id.replace("/", "--"))
    snapshot = base / "snapshots" / commit
    (base / "blobs").mkdir(parents=True, exist_ok=True)
    (base / "refs").mkdir(exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in repo.files:
        blob_name = hashlib.sha256(f"{commit}/{name}".encode()).hexdigest()
        blob = base / "blobs" / blob_name
        if not blob.exists():
            os.link(repo.path / name, blob)
        entry = snapshot / name
        if not entry.is_symlink():
            entry.symlink_to(os.path.relpath(blob, entry.parent))
    (base / "refs" / ref).write_text(commit)
    return snapshot


def cache_files(hf_cache: Path, repo_id: str, commit: str, files: Mapping[str, bytes]) -> Path:
    """`files` (top-level name: bytes) as repo_id@commit in `hf_cache`, each a blob named by its
    sha256, refs/main naming the commit; the repo's dir (models--org--name)."""
    base = hf_cache / ("models--" + repo_id.replace("/", "--"))
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    snapshot = base / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (base / "blobs").mkdir()
    for name, data in files.items():
        blob = base / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return base
