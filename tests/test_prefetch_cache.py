"""sparkdeploy.steps.prefetch.cache: the manifest that recognises a complete repo, the free-space
check, and a cache that huggingface_hub reads as its own."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import huggingface_hub
import pytest
from prefetch_hub import SHA, TINY, fetch, verify_and_record

from lab.engine.standin_model import load_model
from lab.hub.server import HubServer
from sparkdeploy.errors import PrefetchError
from sparkdeploy.steps.prefetch import RepoSpec
from sparkdeploy.steps.prefetch.cache import (
    MANIFEST_DIRNAME,
    MANIFEST_VERSION,
    check_free_space,
    complete_outcome,
    manifest_path,
    storage_dir,
)
from sparkdeploy.steps.prefetch.hub import HubFile

pytest_plugins = ["prefetch_fixtures"]


def test_verified_files_get_a_manifest_that_recognises_the_repo(
    cached_repo: tuple[Path, list[HubFile]],
) -> None:
    cache, files = cached_repo
    assert verify_and_record(cache, files) == []
    outcome = complete_outcome(cache, RepoSpec(TINY, SHA), SHA)
    assert outcome is not None
    assert {f.path: f.verified for f in outcome.files} == {
        "config.json": "git-sha1",
        "model-00001.safetensors": "sha256",
        "sub/model-00002.safetensors": "sha256",
    }
    assert outcome.fetched_bytes == 0
    assert outcome.total_bytes == sum(f.size for f in files)


def test_a_rewritten_file_breaks_the_manifest_match(
    cached_repo: tuple[Path, list[HubFile]],
) -> None:
    cache, files = cached_repo
    verify_and_record(cache, files)
    pointer = storage_dir(cache, TINY) / "snapshots" / SHA / "model-00001.safetensors"
    data = bytearray(pointer.read_bytes())
    data[100] ^= 0xFF
    time.sleep(0.01)  # a distinct mtime even on coarse-timestamp filesystems
    pointer.resolve().write_bytes(bytes(data))
    assert complete_outcome(cache, RepoSpec(TINY, SHA), SHA) is None


def test_manifest_of_another_version_or_commit_is_ignored(
    cached_repo: tuple[Path, list[HubFile]],
) -> None:
    cache, files = cached_repo
    verify_and_record(cache, files)
    path = manifest_path(cache, TINY, SHA)
    data = json.loads(path.read_text())
    data["version"] = MANIFEST_VERSION + 1
    path.write_text(json.dumps(data))
    assert complete_outcome(cache, RepoSpec(TINY, SHA), SHA) is None


def test_free_space_error_names_the_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage._replace(free=5 * 1024**3))
    with pytest.raises(PrefetchError) as raised:
        check_free_space(tmp_path, {"org/big": 7 * 1024**3, "org/small": 0})
    message = str(raised.value)
    assert str(tmp_path) in message
    assert "5.0 GiB (5368709120 bytes) free" in message
    assert "7.0 GiB (7516192768 bytes) more" in message
    assert "org/big 7.0 GiB" in message
    assert "org/small" not in message
    check_free_space(tmp_path, {"org/fits": 5 * 1024**3})


def test_the_cache_resolves_offline_exactly_as_huggingface_hub_writes_it(
    hub: HubServer, nas: Path, repos_dir: Path, tmp_path: Path
) -> None:
    outcome = fetch(hub, nas)
    written_by_hf = tmp_path / "hf"
    # What a deploy takes (selection.py): huggingface_hub told to take the same files.
    huggingface_hub.snapshot_download(
        TINY,
        cache_dir=written_by_hf,
        endpoint=hub.url,
        token=False,
        allow_patterns=[f.path for f in outcome.files],
    )
    hub.stop()

    def layout(cache: Path) -> dict[str, str]:
        storage = storage_dir(cache, TINY)
        """Every blob, ref and snapshot link: link target or content digest, by path."""
        return {
            str(p.relative_to(storage)): (
                os.readlink(p) if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
            )
            for p in storage.rglob("*")
            if MANIFEST_DIRNAME not in p.parts and (p.is_symlink() or p.is_file())
        }

    # huggingface_hub's trees/<sha>.json lists every file of the commit even when it took only
    # some; ours lists the files the snapshot holds, so its offline check finds it complete.
    ours, theirs = layout(nas), layout(written_by_hf)
    tree = f"trees/{outcome.sha}.json"
    assert tree in ours
    assert tree in theirs
    assert {k: v for k, v in ours.items() if k != tree} == {
        k: v for k, v in theirs.items() if k != tree
    }
    snapshot = huggingface_hub.snapshot_download(TINY, cache_dir=nas, local_files_only=True)
    assert Path(snapshot) == Path(outcome.snapshot_dir)
    for f in outcome.files:
        path = huggingface_hub.hf_hub_download(TINY, f.path, cache_dir=nas, local_files_only=True)
        assert Path(path).read_bytes() == (repos_dir / TINY / f.path).read_bytes()
    loaded = load_model(TINY, None, {"HF_HUB_CACHE": str(nas), "HF_HUB_OFFLINE": "1"})
    assert loaded.snapshot == Path(outcome.snapshot_dir)
    assert loaded.shards
    scanned = huggingface_hub.scan_cache_dir(nas)
    assert scanned.warnings == []
    assert [repo.repo_id for repo in scanned.repos] == [TINY]
