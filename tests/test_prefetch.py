"""sparkdeploy.prefetch: manifest, lock, free space and verification without a hub; then the
whole prefetch against the lab hub on loopback."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

from lab.hub import HubServer
from lab.tinymodel import generate_repo
from sparkdeploy import prefetch as pf
from sparkdeploy.errors import PrefetchError, TransientPrefetchError

SHA = "0123456789abcdef0123456789abcdef01234567"
REPO = "lab-org/tiny"


class RecordingObserver:
    def __init__(self) -> None:
        self.progress: list[pf.Progress] = []
        self.messages: list[str] = []

    def on_progress(self, progress: pf.Progress) -> None:
        self.progress.append(progress)

    def on_message(self, message: str) -> None:
        self.messages.append(message)


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def put_cached_file(cache: Path, path: str, data: bytes, *, lfs: bool) -> pf._HubFile:
    """Write one file into the HF cache layout the way huggingface_hub does (blob + symlink)."""
    storage = pf.storage_dir(cache, REPO)
    blob_name = hashlib.sha256(data).hexdigest() if lfs else git_blob_oid(data)
    blob = storage / "blobs" / blob_name
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    pointer = storage / "snapshots" / SHA / path
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    return pf._HubFile(
        path=path,
        size=len(data),
        blob_id=git_blob_oid(data),
        lfs_sha256=hashlib.sha256(data).hexdigest() if lfs else None,
    )


@pytest.fixture
def cached_repo(tmp_path: Path) -> tuple[Path, list[pf._HubFile]]:
    files = [
        put_cached_file(tmp_path, "config.json", b'{"a": 1}\n', lfs=False),
        put_cached_file(tmp_path, "model-00001.safetensors", os.urandom(3 << 20), lfs=True),
        put_cached_file(tmp_path, "sub/model-00002.safetensors", os.urandom(1 << 20), lfs=True),
    ]
    return tmp_path, files


def verify_and_record(cache: Path, files: list[pf._HubFile]) -> list[pf._HubFile]:
    snapshot = pf.storage_dir(cache, REPO) / "snapshots" / SHA
    verified: dict[str, dict[str, Any]] = {}
    to_fetch = pf._check_files(snapshot, files, verified, RecordingObserver(), REPO)
    if not to_fetch:
        pf._write_manifest(cache, REPO, SHA, [verified[f.path] for f in files])
    return to_fetch


def test_file_digest_matches_hashlib_with_and_without_prefix(tmp_path: Path) -> None:
    data = os.urandom((pf._HASH_CHUNK * 2) + 12345)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert pf.file_digest(path, "sha256") == hashlib.sha256(data).hexdigest()
    assert pf.file_digest(path, "sha1", prefix=b"blob %d\0" % len(data)) == git_blob_oid(data)


def test_verified_files_get_a_manifest_that_recognises_the_repo(
    cached_repo: tuple[Path, list[pf._HubFile]],
) -> None:
    cache, files = cached_repo
    assert verify_and_record(cache, files) == []
    outcome = pf._complete_outcome(cache, pf.RepoSpec(REPO, SHA), SHA)
    assert outcome is not None
    assert {f.path: f.verified for f in outcome.files} == {
        "config.json": "git-sha1",
        "model-00001.safetensors": "sha256",
        "sub/model-00002.safetensors": "sha256",
    }
    assert outcome.fetched_bytes == 0
    assert outcome.total_bytes == sum(f.size for f in files)


def test_a_rewritten_file_breaks_the_manifest_match(
    cached_repo: tuple[Path, list[pf._HubFile]],
) -> None:
    cache, files = cached_repo
    verify_and_record(cache, files)
    pointer = pf.storage_dir(cache, REPO) / "snapshots" / SHA / "model-00001.safetensors"
    data = bytearray(pointer.read_bytes())
    data[100] ^= 0xFF
    time.sleep(0.01)  # a distinct mtime even on coarse-timestamp filesystems
    pointer.resolve().write_bytes(bytes(data))
    assert pf._complete_outcome(cache, pf.RepoSpec(REPO, SHA), SHA) is None


def test_corrupt_and_truncated_files_are_removed_for_refetch(
    cached_repo: tuple[Path, list[pf._HubFile]],
) -> None:
    cache, files = cached_repo
    snapshot = pf.storage_dir(cache, REPO) / "snapshots" / SHA
    same_size = snapshot / "model-00001.safetensors"
    blob_of_same_size = same_size.resolve()
    blob_of_same_size.write_bytes(b"\0" * files[1].size)
    truncated = snapshot / "sub/model-00002.safetensors"
    truncated.resolve().write_bytes(b"short")
    observer = RecordingObserver()
    verified: dict[str, dict[str, Any]] = {}
    to_fetch = pf._check_files(snapshot, files, verified, observer, REPO)
    assert [f.path for f in to_fetch] == ["sub/model-00002.safetensors", "model-00001.safetensors"]
    assert set(verified) == {"config.json"}
    assert not same_size.exists() and not same_size.is_symlink()
    assert not blob_of_same_size.exists()
    assert not truncated.is_symlink()
    assert any("does not match its sha256" in m for m in observer.messages)
    assert any("has 5 bytes, the hub says" in m for m in observer.messages)


def test_dangling_snapshot_symlink_counts_as_missing(
    cached_repo: tuple[Path, list[pf._HubFile]],
) -> None:
    cache, files = cached_repo
    snapshot = pf.storage_dir(cache, REPO) / "snapshots" / SHA
    (snapshot / "config.json").resolve().unlink()
    to_fetch = pf._check_files(snapshot, files, {}, RecordingObserver(), REPO)
    assert [f.path for f in to_fetch] == ["config.json"]
    assert not (snapshot / "config.json").is_symlink()


def test_manifest_of_another_version_or_commit_is_ignored(
    cached_repo: tuple[Path, list[pf._HubFile]],
) -> None:
    cache, files = cached_repo
    verify_and_record(cache, files)
    path = pf.manifest_path(cache, REPO, SHA)
    data = json.loads(path.read_text())
    data["version"] = pf.MANIFEST_VERSION + 1
    path.write_text(json.dumps(data))
    assert pf._complete_outcome(cache, pf.RepoSpec(REPO, SHA), SHA) is None


def test_free_space_error_names_the_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(pf.shutil, "disk_usage", lambda _path: usage._replace(free=5 * 1024**3))
    with pytest.raises(PrefetchError) as raised:
        pf.check_free_space(tmp_path, {"org/big": 7 * 1024**3, "org/small": 0})
    message = str(raised.value)
    assert str(tmp_path) in message
    assert "5.0 GiB (5368709120 bytes) free" in message
    assert "7.0 GiB (7516192768 bytes) more" in message
    assert "org/big 7.0 GiB" in message and "org/small" not in message
    pf.check_free_space(tmp_path, {"org/fits": 5 * 1024**3})


def test_missing_cache_dir_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PrefetchError, match="does not exist on this host: mount the NAS"):
        pf.prefetch([pf.RepoSpec(REPO)], tmp_path / "nas-not-mounted", pf.HubAccess("http://x"))


def test_lock_waiter_names_the_holder_and_gets_the_lock_after_release(tmp_path: Path) -> None:
    storage = pf.storage_dir(tmp_path, REPO)
    holder_inside = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def hold() -> None:
        with pf.repo_lock(storage, REPO, wait_s=5, observer=RecordingObserver()):
            order.append("first")
            holder_inside.set()
            release.wait(5)

    first = threading.Thread(target=hold)
    first.start()
    holder_inside.wait(5)
    waiter = RecordingObserver()
    threading.Timer(0.3, release.set).start()
    with pf.repo_lock(storage, REPO, wait_s=5, observer=waiter, poll_s=0.05):
        order.append("second")
    first.join()
    assert order == ["first", "second"]
    assert len(waiter.messages) == 1
    assert f'"pid": {os.getpid()}' in waiter.messages[0]


def test_lock_wait_gives_up_with_a_clear_error(tmp_path: Path) -> None:
    storage = pf.storage_dir(tmp_path, REPO)
    holder_inside = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with pf.repo_lock(storage, REPO, wait_s=5, observer=RecordingObserver()):
            holder_inside.set()
            release.wait(5)

    first = threading.Thread(target=hold)
    first.start()
    holder_inside.wait(5)
    try:
        with (
            pytest.raises(PrefetchError, match="gave up after 0 s waiting for the prefetch lock"),
            pf.repo_lock(storage, REPO, wait_s=0.2, observer=RecordingObserver(), poll_s=0.05),
        ):
            pass
    finally:
        release.set()
        first.join()


def http_error(cls: type[HfHubHTTPError], status: int) -> HfHubHTTPError:
    request = httpx2.Request("GET", "http://127.0.0.1:1/api/models/org/x")
    return cls(f"{status} error", response=httpx2.Response(status, request=request))


@pytest.mark.parametrize(
    ("error", "kind", "words"),
    [
        (http_error(GatedRepoError, 403), PrefetchError, ["org/x@main is gated", "hf-token"]),
        (http_error(RepositoryNotFoundError, 401), PrefetchError, ["HTTP 401", "HF_TOKEN"]),
        (http_error(RepositoryNotFoundError, 404), PrefetchError, ["org/x@main not found"]),
        (http_error(HfHubHTTPError, 503), TransientPrefetchError, ["HTTP 503", "retry later"]),
        (httpx2.ConnectError("Connection refused"), TransientPrefetchError, ["cannot reach"]),
    ],
)
def test_hub_errors_map_to_clear_errors_naming_the_repo(
    error: Exception, kind: type[PrefetchError], words: list[str]
) -> None:
    wrapped = OSError("wrapper")
    wrapped.__cause__ = error
    mapped = pf._map_hub_error(wrapped, pf.RepoSpec("org/x"), pf.HubAccess("http://127.0.0.1:1"))
    assert type(mapped) is kind
    for word in words:
        assert word in str(mapped)


def test_hub_access_repr_hides_the_token() -> None:
    assert "s3cret" not in repr(pf.HubAccess("http://127.0.0.1:1", token="s3cret"))


# --- against the lab hub on loopback -----------------------------------------------------------

TINY = "lab-org/tiny"


@pytest.fixture
def repos_dir(tmp_path: Path) -> Path:
    repos = tmp_path / "repos"
    generate_repo(repos, TINY, num_shards=3, total_bytes=3 << 20)
    return repos


@pytest.fixture
def hub(repos_dir: Path) -> Iterator[HubServer]:
    with HubServer(repos_dir) as server:
        yield server


@pytest.fixture
def nas(tmp_path: Path) -> Path:
    path = tmp_path / "nas"
    path.mkdir()
    return path


def fetch(
    hub: HubServer, nas: Path, repo: str = TINY, revision: str | None = None, **options: Any
) -> pf.RepoOutcome:
    token = options.pop("token", None)
    [outcome] = pf.prefetch(
        [pf.RepoSpec(repo, revision)],
        nas,
        pf.HubAccess(hub.url, token=token, max_workers=4),
        **options,
    )
    return outcome


def snapshot_matches_hub(outcome: pf.RepoOutcome, repos_dir: Path) -> bool:
    source = repos_dir / outcome.repo
    return all(
        (Path(outcome.snapshot_dir) / f.path).read_bytes() == (source / f.path).read_bytes()
        for f in outcome.files
    )


def test_cold_prefetch_then_warm_rerun_fetches_nothing(
    hub: HubServer, nas: Path, repos_dir: Path
) -> None:
    observer = RecordingObserver()
    cold = fetch(hub, nas, observer=observer, progress_interval_s=0.01)
    assert cold.sha == hub.repo_sha(TINY)
    assert cold.fetched_bytes == cold.total_bytes == hub.bytes_served > 3 << 20
    assert {f.verified for f in cold.files if f.path.endswith(".safetensors")} == {"sha256"}
    assert {f.verified for f in cold.files if f.path.endswith(".json")} == {"git-sha1"}
    assert snapshot_matches_hub(cold, repos_dir)
    assert (pf.storage_dir(nas, TINY) / "refs" / "main").read_text() == cold.sha
    assert observer.progress[-1].done_bytes == observer.progress[-1].total_bytes
    assert observer.progress[-1].eta_s == 0.0

    hub.reset_stats()
    warm = fetch(hub, nas)
    assert warm.fetched_bytes == 0 and hub.bytes_served == 0
    assert hub.request_count == 1  # the revision lookup; the manifest answers the rest


def test_pinned_commit_that_is_complete_needs_no_hub(hub: HubServer, nas: Path) -> None:
    sha = fetch(hub, nas).sha
    nobody_listens = hub.url
    hub.stop()
    [outcome] = pf.prefetch([pf.RepoSpec(TINY, sha)], nas, pf.HubAccess(nobody_listens))
    assert outcome.fetched_bytes == 0 and outcome.sha == sha


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


def test_503_on_the_first_call_is_transient_and_a_retry_completes(
    hub: HubServer, nas: Path
) -> None:
    hub.fail_next(1, 503)
    with pytest.raises(TransientPrefetchError, match=f"HTTP 503 for {TINY}"):
        fetch(hub, nas)
    assert fetch(hub, nas).fetched_bytes > 0


def test_503_burst_during_the_download_is_retried_inside(hub: HubServer, nas: Path) -> None:
    class FailWhenFetchingStarts(RecordingObserver):
        def on_message(self, message: str) -> None:
            if "fetching" in message:
                hub.fail_next(2, 503)

    outcome = fetch(hub, nas, observer=FailWhenFetchingStarts())
    assert outcome.fetched_bytes == outcome.total_bytes
    assert [r.status for r in hub.requests()].count(503) == 2


def test_cut_mid_file_resumes_with_only_the_missing_part(repos_dir: Path, nas: Path) -> None:
    # huggingface_hub writes (and so resumes from) whole chunks: the bytes of the partial chunk
    # in flight at the cut are fetched again, nothing before them.
    chunk = pf.DOWNLOAD_CHUNK_BYTES
    generate_repo(repos_dir, "lab-org/big", num_shards=1, total_bytes=12 * chunk, dense_holes=True)
    cut = 7 * chunk + chunk // 2
    big = [pf.RepoSpec("lab-org/big")]
    with HubServer(repos_dir) as hub:
        [first] = pf.prefetch(big, nas, pf.HubAccess(hub.url))
        shard = next(f for f in first.files if f.path.endswith(".safetensors"))
        pf._remove_file(Path(first.snapshot_dir) / shard.path)
        hub.reset_stats()
        hub.cut_next_file(after_bytes=cut)
        [outcome] = pf.prefetch(big, nas, pf.HubAccess(hub.url))
        shard_gets = [r for r in hub.requests() if r.method == "GET" and "/resolve/" in r.path]
    assert [(r.range, r.bytes_sent) for r in shard_gets] == [
        (None, cut),
        (f"bytes={7 * chunk}-", shard.size - 7 * chunk),
    ]
    assert snapshot_matches_hub(outcome, repos_dir)


def test_unknown_repo_and_revision_are_clear_errors(hub: HubServer, nas: Path) -> None:
    with pytest.raises(PrefetchError, match="lab-org/nope@main not found") as raised:
        fetch(hub, nas, repo="lab-org/nope")
    assert not isinstance(raised.value, TransientPrefetchError)
    with pytest.raises(PrefetchError, match=f"{TINY} has no revision 'v9'"):
        fetch(hub, nas, revision="v9")


def test_gated_repo_names_the_repo_and_the_token_source(repos_dir: Path, nas: Path) -> None:
    generate_repo(repos_dir, "lab-org/gated", total_bytes=64 << 10, gated_tokens=["hf_good"])
    with HubServer(repos_dir) as hub:
        with pytest.raises(PrefetchError, match="lab-org/gated") as anonymous:
            fetch(hub, nas, repo="lab-org/gated")
        assert "no token is set" in str(anonymous.value) and "hf-token" in str(anonymous.value)
        with pytest.raises(PrefetchError, match="has no access") as wrong:
            fetch(hub, nas, repo="lab-org/gated", token="hf_wrong")
        assert "hf_wrong" not in str(wrong.value)
        assert fetch(hub, nas, repo="lab-org/gated", token="hf_good").fetched_bytes > 0


def test_two_concurrent_prefetches_download_once(hub: HubServer, nas: Path) -> None:
    hub.slow(2 << 20)  # per response: about 1.5 s for the largest shard
    first_observer, second_observer = RecordingObserver(), RecordingObserver()
    downloading = threading.Event()

    class Signalling(RecordingObserver):
        def on_progress(self, progress: pf.Progress) -> None:
            first_observer.on_progress(progress)
            if progress.done_bytes > 0:
                downloading.set()

        def on_message(self, message: str) -> None:
            first_observer.on_message(message)

    results: dict[str, pf.RepoOutcome] = {}
    first = threading.Thread(
        target=lambda: results.update(
            first=fetch(hub, nas, observer=Signalling(), progress_interval_s=0.02)
        )
    )
    first.start()
    assert downloading.wait(10)
    results["second"] = fetch(hub, nas, observer=second_observer, lock_wait_s=30)
    first.join()
    assert results["first"].fetched_bytes == results["first"].total_bytes
    assert results["second"].fetched_bytes == 0
    assert hub.bytes_served == results["first"].total_bytes
    assert any("waiting for" in m for m in second_observer.messages)
    assert any("completed by another prefetch" in m for m in second_observer.messages)


def test_not_enough_space_fails_before_fetching_anything(
    hub: HubServer, nas: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = shutil.disk_usage(nas)
    monkeypatch.setattr(pf.shutil, "disk_usage", lambda _path: usage._replace(free=1 << 20))
    with pytest.raises(PrefetchError, match=f"needs 3.0 MiB .* more: {TINY} 3.0 MiB"):
        fetch(hub, nas)
    assert hub.bytes_served == 0
