"""huggingface_hub's commit file list (`trees/<sha>.json` in a repo's cache dir), written as its
own snapshot_download writes it.

The writer is private to huggingface_hub (huggingface_hub/_tree_cache.py, `write_tree_cache`
and `TreeCacheEntry`, 2.4), so this module is the one place that imports it;
tests/test_hf_tree_cache.py fails when an upgrade changes what it relies on. Its offline
snapshot_download checks a snapshot against that list, and an online one skips the tree listing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache


@dataclass(frozen=True)
class TreeFile:
    size: int
    blob_id: str  # the git blob id of the file (of its pointer, for an LFS file)
    lfs_sha256: str | None  # None: not an LFS file


def write_commit_files(storage: Path, commit: str, files: Mapping[str, TreeFile]) -> None:
    """Record `commit`'s files (path -> facts) in the repo cache dir `storage`."""
    entries = {
        path: TreeCacheEntry(
            size=file.size,
            blob_id=file.blob_id,
            lfs_sha256=file.lfs_sha256,
            lfs_size=file.size if file.lfs_sha256 is not None else None,
        )
        for path, file in files.items()
    }
    write_tree_cache(str(storage), commit, entries)
