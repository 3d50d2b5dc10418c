"""The adapter over huggingface_hub's private tree cache: what it writes is what huggingface_hub
reads, and the private names it uses still exist with the same shape (an upgrade that changes
them fails here, not in a prefetch)."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import _tree_cache

from lab.testing.hfcache_layout import cache_files
from sparkdeploy.remote.hf_tree_cache import TreeFile, write_commit_files

REPO = "lab-org/tree"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_the_private_names_have_the_shape_the_adapter_relies_on() -> None:
    parameters = list(inspect.signature(_tree_cache.write_tree_cache).parameters)
    assert parameters == ["tree_cache_folder", "commit_hash", "entries"]
    fields = {field.name for field in dataclasses.fields(_tree_cache.TreeCacheEntry)}
    assert {"size", "blob_id", "lfs_sha256", "lfs_size"} <= fields


def test_huggingface_hub_reads_the_file_list_back_and_checks_the_snapshot_against_it(
    tmp_path: Path,
) -> None:
    files = {"config.json": b"{}", "model.safetensors": b"weights"}
    storage = cache_files(tmp_path, REPO, COMMIT, files)
    write_commit_files(
        storage,
        COMMIT,
        {
            name: TreeFile(size=len(data), blob_id=hashlib.sha1(data).hexdigest(), lfs_sha256=None)
            for name, data in files.items()
        },
    )
    read = _tree_cache.read_tree_cache(str(storage), COMMIT)
    assert read is not None
    assert set(read) == set(files)
    snapshot = huggingface_hub.snapshot_download(REPO, cache_dir=tmp_path, local_files_only=True)
    assert Path(snapshot) == storage / "snapshots" / COMMIT

    (storage / "snapshots" / COMMIT / "model.safetensors").unlink()
    with pytest.raises(huggingface_hub.errors.LocalEntryNotFoundError):
        huggingface_hub.snapshot_download(REPO, cache_dir=tmp_path, local_files_only=True)
