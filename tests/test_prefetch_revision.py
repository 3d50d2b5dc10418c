"""sparkdeploy.steps.prefetch.revision: what a revision is, asked of the lab hub on loopback
through the prefetch: a pinned commit needs no hub, a missing repo or revision is named, a rate
limit is waited out within its bound."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import snapshot_download
from prefetch_hub import TINY, RecordingObserver, fetch, snapshot_matches_hub

from lab.hub.server import HubServer
from sparkdeploy.errors import PrefetchError, TransientPrefetchError
from sparkdeploy.node.hfcache import resolve_snapshot
from sparkdeploy.steps.prefetch import HubAccess, RepoSpec, prefetch

pytest_plugins = ["prefetch_fixtures"]


def test_pinned_commit_that_is_complete_needs_no_hub(hub: HubServer, nas: Path) -> None:
    sha = fetch(hub, nas).sha
    nobody_listens = hub.url
    hub.stop()
    [outcome] = prefetch([RepoSpec(TINY, sha)], nas, HubAccess(nobody_listens))
    assert outcome.fetched_bytes == 0
    assert outcome.sha == sha


def test_503_on_the_first_call_is_transient_and_a_retry_completes(
    hub: HubServer, nas: Path
) -> None:
    hub.fail_next(1, 503)
    with pytest.raises(TransientPrefetchError, match=f"HTTP 503 for {TINY}"):
        fetch(hub, nas)
    assert fetch(hub, nas).fetched_bytes > 0


def test_unknown_repo_and_revision_are_clear_errors(hub: HubServer, nas: Path) -> None:
    with pytest.raises(PrefetchError, match="lab-org/nope@main not found") as raised:
        fetch(hub, nas, repo="lab-org/nope")
    assert not isinstance(raised.value, TransientPrefetchError)
    with pytest.raises(PrefetchError, match=f"{TINY} has no revision 'v9'"):
        fetch(hub, nas, revision="v9")


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


def test_an_unpinned_repo_stays_at_the_commit_the_nas_holds_until_asked_to_move(
    hub: HubServer, nas: Path, repos_dir: Path
) -> None:
    """main is resolved when the repo first enters the NAS; the hub's main moving since (here a
    new file, as a repo that grew `original/` copies) changes nothing for later prefetches, and
    costs no hub call, until update_revisions asks for the newer commit."""
    first = fetch(hub, nas)
    (repos_dir / TINY / "original").mkdir()
    (repos_dir / TINY / "original" / "consolidated.safetensors").write_bytes(b"\0" * 4096)
    hub.reset_stats()
    observer = RecordingObserver()
    again = fetch(hub, nas, observer=observer)
    assert again.sha == first.sha
    assert again.fetched_bytes == 0
    assert hub.request_count == 0
    assert any("as the NAS cache holds it" in m for m in observer.messages), observer.messages
    assert resolve_snapshot(str(nas), TINY, None)[0] == first.sha

    observer = RecordingObserver()
    moved = fetch(hub, nas, observer=observer, update_revisions=True)
    assert moved.sha != first.sha
    assert any(f"moved from {first.sha[:12]} to {moved.sha[:12]}" in m for m in observer.messages)
    assert resolve_snapshot(str(nas), TINY, None)[0] == moved.sha


def test_a_cache_filled_by_snapshot_download_is_adopted_without_fetching_a_byte(
    hub: HubServer, nas: Path
) -> None:
    """What `hf download` leaves (huggingface_hub's own snapshot_download, from the same hub) is
    hashed once and adopted: no byte is fetched, and the next prefetch asks the hub nothing.
    rehash hashes every file again."""
    snapshot_download(TINY, cache_dir=nas, endpoint=hub.url, token=False)
    hub.reset_stats()
    observer = RecordingObserver()
    adopted = fetch(hub, nas, observer=observer)
    assert adopted.fetched_bytes == 0
    assert hub.bytes_served == 0
    hashed = [m for m in observer.messages if "hashed" in m]
    assert hashed, observer.messages
    assert f"({adopted.total_bytes} bytes)" in hashed[0], observer.messages
    hub.reset_stats()
    assert fetch(hub, nas).fetched_bytes == 0
    assert hub.request_count == 0
    observer = RecordingObserver()
    assert fetch(hub, nas, observer=observer, rehash=True).fetched_bytes == 0
    assert any("hashed" in m for m in observer.messages), observer.messages
