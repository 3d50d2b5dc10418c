"""sparkdeploy.steps.prefetch: manifest, lock, free space and verification without a hub; then the
whole prefetch against the lab hub on loopback."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import huggingface_hub
import pytest
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import hf_raise_for_status

from lab.engine.standin_model import load_model
from lab.hub import HUB, STORAGE, HubServer, RequestRecord, fingerprint
from lab.tinymodel import generate_repo
from sparkdeploy.errors import PrefetchError, TransientPrefetchError
from sparkdeploy.remote import blobfetch
from sparkdeploy.steps import prefetch as pf

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


def test_hub_file_digests_match_sha256_and_the_git_blob_oid(tmp_path: Path) -> None:
    data = os.urandom((blobfetch.HASH_CHUNK_BYTES * 2) + 12345)
    path = tmp_path / "f"
    path.write_bytes(data)
    lfs = pf._HubFile("f", len(data), git_blob_oid(data), hashlib.sha256(data).hexdigest())
    small = pf._HubFile("f", len(data), git_blob_oid(data), None)
    for f in (lfs, small):
        digest = f.new_digest()
        blobfetch.hash_file(digest, path)
        assert digest.hexdigest() == f.expected_digest == f.blob_name
    prefix = hashlib.sha256()
    blobfetch.hash_file(prefix, path, 1000)
    assert prefix.hexdigest() == hashlib.sha256(data[:1000]).hexdigest()


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


def http_error(status: int, **headers: str) -> HfHubHTTPError:
    """What huggingface_hub raises for a hub answer: headers as the hub sends them (X-Error-Code
    as X_Error_Code)."""
    request = httpx2.Request("GET", "http://127.0.0.1:1/api/models/org/x")
    response = httpx2.Response(
        status,
        request=request,
        headers={name.replace("_", "-"): value for name, value in headers.items()},
    )
    try:
        hf_raise_for_status(response)
    except HfHubHTTPError as error:
        return error
    raise AssertionError(f"HTTP {status} raised nothing")


ANONYMOUS = pf.HubAccess("http://127.0.0.1:1")
WITH_TOKEN = pf.HubAccess("http://127.0.0.1:1", token="hf_x", token_source="HF_TOKEN")


@pytest.mark.parametrize(
    ("error", "hub", "kind", "words"),
    [
        (
            http_error(401, X_Error_Code="GatedRepo"),
            ANONYMOUS,
            PrefetchError,
            [
                "org/x@main is a gated repo",
                "no token was sent",
                "accept the licence at http://127.0.0.1:1/org/x",
                "set HF_TOKEN (or the Prefect Secret block 'hf-token')",
            ],
        ),
        (
            http_error(403, X_Error_Code="GatedRepo"),
            WITH_TOKEN,
            PrefetchError,
            ["HTTP 403 GatedRepo", "the token from HF_TOKEN has no access", "licence"],
        ),
        (
            http_error(401, X_Error_Code="RepoNotFound"),
            ANONYMOUS,
            PrefetchError,
            ["org/x@main not found", "HTTP 401 RepoNotFound", "repo name", "HF_TOKEN"],
        ),
        (
            http_error(404, X_Error_Code="RepoNotFound"),
            WITH_TOKEN,
            PrefetchError,
            ["org/x@main not found", "the token from HF_TOKEN cannot read it"],
        ),
        (
            http_error(404, X_Error_Code="RevisionNotFound"),
            ANONYMOUS,
            PrefetchError,
            ["org/x has no revision 'main'", "fix the revision pinned in the recipe"],
        ),
        (
            http_error(401, X_Error_Message="Invalid credentials in Authorization header"),
            WITH_TOKEN,
            PrefetchError,
            ["refused the token from HF_TOKEN", "revoked, expired or mistyped"],
        ),
        (http_error(503), ANONYMOUS, TransientPrefetchError, ["HTTP 503", "retry later"]),
        (
            http_error(429, Retry_After="7"),
            ANONYMOUS,
            TransientPrefetchError,
            ["HTTP 429 for org/x@main with Retry-After: 7 s", "retry later"],
        ),
        (
            http_error(429, Retry_After="900"),
            ANONYMOUS,
            TransientPrefetchError,
            ["Retry-After: 900 s, longer than the 300 s a prefetch waits in place"],
        ),
        (
            httpx2.ConnectError("Connection refused"),
            ANONYMOUS,
            TransientPrefetchError,
            ["cannot reach"],
        ),
    ],
)
def test_hub_errors_map_to_clear_errors_naming_the_repo(
    error: Exception, hub: pf.HubAccess, kind: type[PrefetchError], words: list[str]
) -> None:
    wrapped = OSError("wrapper")
    wrapped.__cause__ = error
    mapped = pf._map_hub_error(wrapped, pf.RepoSpec("org/x"), hub)
    assert type(mapped) is kind
    for word in words:
        assert word in str(mapped)
    assert "hf_x" not in str(mapped)


def test_a_429s_wait_travels_with_the_error_and_survives_pickling() -> None:
    mapped = pf._map_hub_error(http_error(429, Retry_After="7"), pf.RepoSpec("org/x"), ANONYMOUS)
    assert isinstance(mapped, TransientPrefetchError)
    assert pickle.loads(pickle.dumps(mapped)).retry_after_s == mapped.retry_after_s == 7.0


@pytest.mark.parametrize(
    ("status", "code", "kind", "words"),
    [
        (
            404,
            "EntryNotFound",
            PrefetchError,
            ["w.safetensors is in the file list of commit", "lost the file", "pin another"],
        ),
        (404, "RevisionNotFound", TransientPrefetchError, ["force-push", "new head"]),
        (401, "GatedRepo", PrefetchError, ["is a gated repo", "accept the licence"]),
    ],
)
def test_download_refusals_name_the_file_and_the_fix(
    status: int, code: str, kind: type[PrefetchError], words: list[str]
) -> None:
    download = pf._Download("w.safetensors", SHA, "http://127.0.0.1:1/org/x/resolve/sha/w")
    mapped = pf._status_error(
        status, pf.RepoSpec("org/x"), ANONYMOUS, error_code=code, download=download
    )
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
        pf.HubAccess(hub.url, token=token, max_workers=4, retry_backoff_s=0.01),
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


def resolve_gets(hub: HubServer) -> list[RequestRecord]:
    """The GETs that answered with a file's bytes: a small file's from the hub, an LFS file's
    from the storage host the hub redirected to."""
    return [
        r
        for r in hub.requests()
        if r.method == "GET"
        and r.status in (200, 206)
        and ("/resolve/" in r.path or r.origin == STORAGE)
    ]


def test_cut_mid_file_is_resumed_inside_the_call_from_the_exact_byte(
    repos_dir: Path, nas: Path
) -> None:
    generate_repo(repos_dir, "lab-org/big", num_shards=1, total_bytes=12 << 20, dense_holes=True)
    cut = (7 << 20) + 12345
    big = [pf.RepoSpec("lab-org/big")]
    with HubServer(repos_dir) as hub:
        [first] = pf.prefetch(big, nas, pf.HubAccess(hub.url))
        shard = next(f for f in first.files if f.path.endswith(".safetensors"))
        pf._remove_file(Path(first.snapshot_dir) / shard.path)
        hub.reset_stats()
        hub.cut_next_file(after_bytes=cut)
        observer = RecordingObserver()
        [outcome] = pf.prefetch(
            big, nas, pf.HubAccess(hub.url, retry_backoff_s=0.01), observer=observer
        )
        shard_gets = resolve_gets(hub)
    assert [(r.range, r.bytes_sent) for r in shard_gets] == [
        (None, cut),
        (f"bytes={cut}-", shard.size - cut),
    ]
    assert any(f"retrying from byte {cut}" in m for m in observer.messages)
    assert snapshot_matches_hub(outcome, repos_dir)


def test_a_failed_prefetch_keeps_its_partial_and_the_next_one_fetches_only_the_rest(
    repos_dir: Path, nas: Path
) -> None:
    generate_repo(repos_dir, "lab-org/big", num_shards=2, total_bytes=8 << 20)
    cut = (3 << 20) + 4321
    big = [pf.RepoSpec("lab-org/big")]
    with HubServer(repos_dir) as hub:
        hub.cut_next_file(after_bytes=cut)
        # One connection takes the largest file first, so the cut lands in it; one attempt.
        no_retries = pf.HubAccess(hub.url, max_workers=1, download_attempts=1)
        with pytest.raises(TransientPrefetchError, match="next try resumes") as raised:
            pf.prefetch(big, nas, no_retries)
        assert hub.bytes_served == cut
        partials = list((pf.storage_dir(nas, "lab-org/big") / "blobs").glob("*.incomplete"))
        assert [p.stat().st_size for p in partials] == [cut]
        assert str(partials[0]) in str(raised.value)

        hub.reset_stats()
        observer = RecordingObserver()
        [outcome] = pf.prefetch(big, nas, pf.HubAccess(hub.url), observer=observer)
        gets = resolve_gets(hub)
    assert hub.bytes_served == outcome.total_bytes - cut
    assert [r.range for r in gets if r.range is not None] == [f"bytes={cut}-"]
    assert any(f"resuming from byte {cut}" in m for m in observer.messages)
    assert snapshot_matches_hub(outcome, repos_dir)
    assert not list((pf.storage_dir(nas, "lab-org/big") / "blobs").glob("*.incomplete"))


def test_a_killed_prefetch_process_is_resumed_from_its_partial(repos_dir: Path, nas: Path) -> None:
    generate_repo(repos_dir, "lab-org/big", num_shards=1, total_bytes=8 << 20)
    blobs = pf.storage_dir(nas, "lab-org/big") / "blobs"
    with HubServer(repos_dir) as hub:
        hub.slow(2 << 20)
        script = (
            "import sys; from pathlib import Path; from sparkdeploy.steps import prefetch as pf; "
            "pf.prefetch([pf.RepoSpec('lab-org/big')], Path(sys.argv[1]), "
            "pf.HubAccess(sys.argv[2], max_workers=1))"
        )
        child = subprocess.Popen(
            [sys.executable, "-c", script, str(nas), hub.url],
            cwd=Path(__file__).resolve().parents[1],
        )
        try:
            deadline = time.monotonic() + 30
            while sum(p.stat().st_size for p in blobs.glob("*.incomplete")) < 1 << 20:
                assert child.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        finally:
            child.kill()
            child.wait(timeout=10)
        [partial] = blobs.glob("*.incomplete")
        kept = partial.stat().st_size
        hub.slow(None)
        hub.reset_stats()
        [outcome] = pf.prefetch([pf.RepoSpec("lab-org/big")], nas, pf.HubAccess(hub.url))
        gets = resolve_gets(hub)
    assert [r.range for r in gets if r.range is not None] == [f"bytes={kept}-"]
    # Counted per request: the killed run's response may still be draining into a dead socket.
    assert sum(r.bytes_sent for r in gets) == outcome.total_bytes - kept
    assert snapshot_matches_hub(outcome, repos_dir)


def test_redirects_are_followed_and_the_token_never_leaves_the_hub_host(
    repos_dir: Path, nas: Path
) -> None:
    generate_repo(repos_dir, "lab-org/gated", total_bytes=1 << 20, gated_tokens=["hf_good"])
    with HubServer(repos_dir, storage_host="127.0.0.2") as hub:
        outcome = fetch(hub, nas, repo="lab-org/gated", token="hf_good")
        requests = hub.requests()
        by_origin = hub.authorization_by_origin()
    assert snapshot_matches_hub(outcome, repos_dir)
    lfs = [f for f in outcome.files if f.path.endswith(".safetensors")]
    redirected = [r for r in requests if r.origin == HUB and r.status == 302]
    stored = [r for r in requests if r.origin == STORAGE]
    assert len(redirected) == len(stored) == len(lfs) > 0
    assert all(r.authorized for r in redirected) and not any(r.authorized for r in stored)
    assert by_origin == {HUB: [fingerprint("Bearer hf_good")], STORAGE: []}


def test_the_cache_resolves_offline_exactly_as_huggingface_hub_writes_it(
    hub: HubServer, nas: Path, repos_dir: Path, tmp_path: Path
) -> None:
    outcome = fetch(hub, nas)
    written_by_hf = tmp_path / "hf"
    huggingface_hub.snapshot_download(TINY, cache_dir=written_by_hf, endpoint=hub.url, token=False)
    hub.stop()

    def layout(cache: Path) -> dict[str, str]:
        storage = pf.storage_dir(cache, TINY)
        """Every blob, ref and snapshot link: link target or content digest, by path."""
        return {
            str(p.relative_to(storage)): (
                os.readlink(p) if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
            )
            for p in storage.rglob("*")
            if pf.MANIFEST_DIRNAME not in p.parts and (p.is_symlink() or p.is_file())
        }

    assert layout(nas) == layout(written_by_hf)
    snapshot = huggingface_hub.snapshot_download(TINY, cache_dir=nas, local_files_only=True)
    assert Path(snapshot) == Path(outcome.snapshot_dir)
    for f in outcome.files:
        path = huggingface_hub.hf_hub_download(TINY, f.path, cache_dir=nas, local_files_only=True)
        assert Path(path).read_bytes() == (repos_dir / TINY / f.path).read_bytes()
    loaded = load_model(TINY, None, {"HF_HUB_CACHE": str(nas), "HF_HUB_OFFLINE": "1"})
    assert loaded.snapshot == Path(outcome.snapshot_dir) and loaded.shards
    scanned = huggingface_hub.scan_cache_dir(nas)
    assert scanned.warnings == []
    assert [repo.repo_id for repo in scanned.repos] == [TINY]


def resident_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache (util-linux fincore)."""
    argv = ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)]
    return int(subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout)


def test_fetched_files_are_left_out_of_the_page_cache(repos_dir: Path, nas: Path) -> None:
    generate_repo(repos_dir, "lab-org/big", num_shards=1, total_bytes=80 << 20)
    with HubServer(repos_dir) as hub:
        [outcome] = pf.prefetch([pf.RepoSpec("lab-org/big")], nas, pf.HubAccess(hub.url))
    blobs = [(Path(outcome.snapshot_dir) / f.path).resolve() for f in outcome.files]
    assert max(b.stat().st_size for b in blobs) > 64 << 20
    assert {b.name: resident_bytes(b) for b in blobs} == {b.name: 0 for b in blobs}


def test_unknown_repo_and_revision_are_clear_errors(hub: HubServer, nas: Path) -> None:
    with pytest.raises(PrefetchError, match="lab-org/nope@main not found") as raised:
        fetch(hub, nas, repo="lab-org/nope")
    assert not isinstance(raised.value, TransientPrefetchError)
    with pytest.raises(PrefetchError, match=f"{TINY} has no revision 'v9'"):
        fetch(hub, nas, revision="v9")


def test_gated_repo_names_the_repo_and_the_token_source(repos_dir: Path, nas: Path) -> None:
    generate_repo(repos_dir, "lab-org/gated", total_bytes=64 << 10, gated_tokens=["hf_good"])
    storage = pf.storage_dir(nas, "lab-org/gated")
    with HubServer(repos_dir) as hub:
        with pytest.raises(PrefetchError, match="lab-org/gated") as anonymous:
            fetch(hub, nas, repo="lab-org/gated")
        assert "no token was sent" in str(anonymous.value)
        assert f"accept the licence at {hub.url}/lab-org/gated" in str(anonymous.value)
        assert "'hf-token'" in str(anonymous.value)
        with pytest.raises(PrefetchError, match="has no access") as wrong:
            fetch(hub, nas, repo="lab-org/gated", token="hf_wrong")
        assert "hf_wrong" not in str(wrong.value)
        assert not isinstance(wrong.value, TransientPrefetchError)
        # Nothing of the refused downloads is left, least of all as complete.
        assert not list(storage.rglob("*.incomplete"))
        assert not list((storage / pf.MANIFEST_DIRNAME).glob("*.json"))
        assert not [p for p in storage.rglob("*") if p.is_file() and "blobs" in p.parts]
        assert fetch(hub, nas, repo="lab-org/gated", token="hf_good").fetched_bytes > 0


def test_a_429_is_waited_for_as_its_retry_after_says_then_the_prefetch_completes(
    hub: HubServer, nas: Path, repos_dir: Path
) -> None:
    class RateLimitedDownloads(RecordingObserver):
        """The hub rate-limits the first download request once the downloads begin."""

        def on_message(self, message: str) -> None:
            super().on_message(message)
            if "fetching" in message:
                hub.rate_limit(1, retry_after_s=1)

    hub.rate_limit(1, retry_after_s=1)
    observer = RateLimitedDownloads()
    outcome = fetch(hub, nas, observer=observer)
    assert snapshot_matches_hub(outcome, repos_dir)
    assert [r.status for r in hub.requests()].count(429) == 2
    waits = [m for m in observer.messages if "Retry-After" in m]
    assert len(waits) == 2, observer.messages
    assert "HTTP 429 for lab-org/tiny@main with Retry-After: 1 s" in waits[0]
    assert (
        "waiting the 1 s its Retry-After asks for, then asking again (attempt 2 of 5)" in waits[0]
    )
    assert "(Retry-After: 1 s); retrying from byte 0 in 1 s" in waits[1]


def test_a_retry_after_longer_than_the_bound_is_not_waited_for(hub: HubServer, nas: Path) -> None:
    hub.rate_limit(1, retry_after_s=600)
    with pytest.raises(TransientPrefetchError, match="longer than the 300 s") as raised:
        fetch(hub, nas)
    assert raised.value.retry_after_s == 600
    assert hub.request_count == 1


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
