"""sparkdeploy.steps.prefetch.verify: files that do not match the hub's digests are removed and
fetched again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefetch_hub import SHA, TINY, RecordingObserver, fetch, snapshot_matches_hub

from lab.hub.server import HubServer
from sparkdeploy.steps.prefetch.cache import storage_dir
from sparkdeploy.steps.prefetch.hub import HubFile
from sparkdeploy.steps.prefetch.verify import check_files

pytest_plugins = ["prefetch_fixtures"]


def test_corrupt_and_truncated_files_are_removed_for_refetch(
    cached_repo: tuple[Path, list[HubFile]],
) -> None:
    cache, files = cached_repo
    snapshot = storage_dir(cache, TINY) / "snapshots" / SHA
    same_size = snapshot / "model-00001.safetensors"
    blob_of_same_size = same_size.resolve()
    blob_of_same_size.write_bytes(b"\0" * files[1].size)
    truncated = snapshot / "sub/model-00002.safetensors"
    truncated.resolve().write_bytes(b"short")
    observer = RecordingObserver()
    verified: dict[str, dict[str, Any]] = {}
    to_fetch = check_files(snapshot, files, verified, observer, TINY)
    assert [f.path for f in to_fetch] == ["sub/model-00002.safetensors", "model-00001.safetensors"]
    assert set(verified) == {"config.json"}
    assert not same_size.exists()
    assert not same_size.is_symlink()
    assert not blob_of_same_size.exists()
    assert not truncated.is_symlink()
    assert any("does not match its sha256" in m for m in observer.messages)
    assert any("has 5 bytes, the hub says" in m for m in observer.messages)


def test_dangling_snapshot_symlink_counts_as_missing(
    cached_repo: tuple[Path, list[HubFile]],
) -> None:
    cache, files = cached_repo
    snapshot = storage_dir(cache, TINY) / "snapshots" / SHA
    (snapshot / "config.json").resolve().unlink()
    to_fetch = check_files(snapshot, files, {}, RecordingObserver(), TINY)
    assert [f.path for f in to_fetch] == ["config.json"]
    assert not (snapshot / "config.json").is_symlink()


def test_corrupt_file_is_fetched_again(hub: HubServer, nas: Path, repos_dir: Path) -> None:
    first = fetch(hub, nas)
    victim = next(f for f in first.files if f.path.endswith(".safetensors"))
    blob = (Path(first.snapshot_dir) / victim.path).resolve()
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    hub.reset_stats()
    observer = RecordingObserver()
    again = fetch(hub, nas, observer=observer)
    assert [f.path for f in again.files if f.fetched] == [victim.path]
    assert hub.bytes_served == victim.size
    assert snapshot_matches_hub(again, repos_dir)
    assert any(victim.path in m and "does not match its sha256" in m for m in observer.messages)


def test_truncated_file_is_fetched_again(hub: HubServer, nas: Path, repos_dir: Path) -> None:
    first = fetch(hub, nas)
    victim = next(f for f in first.files if f.path == "config.json")
    (Path(first.snapshot_dir) / victim.path).resolve().write_bytes(b"{}")
    again = fetch(hub, nas)
    assert [f.path for f in again.files if f.fetched] == ["config.json"]
    assert snapshot_matches_hub(again, repos_dir)
