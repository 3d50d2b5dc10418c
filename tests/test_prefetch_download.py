"""sparkdeploy.steps.prefetch.download against the lab hub on loopback: retries and resumes from
the exact byte, redirects without the token, bytes left out of the page cache."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefetch_hub import RecordingObserver, fetch, resolve_gets, snapshot_matches_hub

from lab.hub.request_log import HUB, STORAGE, fingerprint
from lab.hub.server import HubServer
from lab.testing.page_cache import resident_bytes
from lab.tinymodel import generate_repo
from sparkdeploy.errors import TransientPrefetchError
from sparkdeploy.steps.prefetch import HubAccess, RepoSpec, prefetch
from sparkdeploy.steps.prefetch.cache import remove_file, storage_dir

pytest_plugins = ["prefetch_fixtures"]


def test_503_burst_during_the_download_is_retried_inside(hub: HubServer, nas: Path) -> None:
    class FailWhenFetchingStarts(RecordingObserver):
        def on_message(self, message: str) -> None:
            if "fetching" in message:
                hub.fail_next(2, 503)

    outcome = fetch(hub, nas, observer=FailWhenFetchingStarts())
    assert outcome.fetched_bytes == outcome.total_bytes
    assert [r.status for r in hub.requests()].count(503) == 2


def test_cut_mid_file_is_resumed_inside_the_call_from_the_exact_byte(
    repos_dir: Path, nas: Path
) -> None:
    generate_repo(repos_dir, "lab-org/big", num_shards=1, total_bytes=12 << 20, dense_holes=True)
    cut = (7 << 20) + 12345
    big = [RepoSpec("lab-org/big")]
    with HubServer(repos_dir) as hub:
        [first] = prefetch(big, nas, HubAccess(hub.url))
        shard = next(f for f in first.files if f.path.endswith(".safetensors"))
        remove_file(Path(first.snapshot_dir) / shard.path)
        hub.reset_stats()
        hub.cut_next_file(after_bytes=cut)
        observer = RecordingObserver()
        [outcome] = prefetch(big, nas, HubAccess(hub.url, retry_backoff_s=0.01), observer=observer)
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
    big = [RepoSpec("lab-org/big")]
    with HubServer(repos_dir) as hub:
        hub.cut_next_file(after_bytes=cut)
        # One connection takes the largest file first, so the cut lands in it; one attempt.
        no_retries = HubAccess(hub.url, max_workers=1, download_attempts=1)
        with pytest.raises(TransientPrefetchError, match="next try resumes") as raised:
            prefetch(big, nas, no_retries)
        assert hub.bytes_served == cut
        partials = list((storage_dir(nas, "lab-org/big") / "blobs").glob("*.incomplete"))
        assert [p.stat().st_size for p in partials] == [cut]
        assert str(partials[0]) in str(raised.value)

        hub.reset_stats()
        observer = RecordingObserver()
        [outcome] = prefetch(big, nas, HubAccess(hub.url), observer=observer)
        gets = resolve_gets(hub)
    assert hub.bytes_served == outcome.total_bytes - cut
    assert [r.range for r in gets if r.range is not None] == [f"bytes={cut}-"]
    assert any(f"resuming from byte {cut}" in m for m in observer.messages)
    assert snapshot_matches_hub(outcome, repos_dir)
    assert not list((storage_dir(nas, "lab-org/big") / "blobs").glob("*.incomplete"))


def test_a_killed_prefetch_process_is_resumed_from_its_partial(repos_dir: Path, nas: Path) -> None:
    generate_repo(repos_dir, "lab-org/big", num_shards=1, total_bytes=8 << 20)
    blobs = storage_dir(nas, "lab-org/big") / "blobs"
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
                assert child.poll() is None
                assert time.monotonic() < deadline
                time.sleep(0.05)
        finally:
            child.kill()
            child.wait(timeout=10)
        [partial] = blobs.glob("*.incomplete")
        kept = partial.stat().st_size
        hub.slow(None)
        hub.reset_stats()
        [outcome] = prefetch([RepoSpec("lab-org/big")], nas, HubAccess(hub.url))
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
    assert all(r.authorized for r in redirected)
    assert not any(r.authorized for r in stored)
    assert by_origin == {HUB: [fingerprint("Bearer hf_good")], STORAGE: []}


def test_fetched_files_are_left_out_of_the_page_cache(repos_dir: Path, nas: Path) -> None:
    generate_repo(repos_dir, "lab-org/big", num_shards=1, total_bytes=80 << 20)
    with HubServer(repos_dir) as hub:
        [outcome] = prefetch([RepoSpec("lab-org/big")], nas, HubAccess(hub.url))
    blobs = [(Path(outcome.snapshot_dir) / f.path).resolve() for f in outcome.files]
    assert max(b.stat().st_size for b in blobs) > 64 << 20
    assert {b.name: resident_bytes(b) for b in blobs} == {b.name: 0 for b in blobs}
