"""sparkdeploy.steps.prefetch as its callers use it: the whole step, through its facade, against
the lab hub on loopback."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from prefetch_hub import TINY, RecordingObserver, fetch, snapshot_matches_hub

from lab.hub.server import HubServer
from sparkdeploy.errors import PrefetchError
from sparkdeploy.steps.prefetch import HubAccess, RepoSpec, prefetch
from sparkdeploy.steps.prefetch.cache import storage_dir

pytest_plugins = ["prefetch_fixtures"]


def test_missing_cache_dir_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PrefetchError, match="does not exist on this host: mount the NAS"):
        prefetch([RepoSpec(TINY)], tmp_path / "nas-not-mounted", HubAccess("http://x"))


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
    assert (storage_dir(nas, TINY) / "refs" / "main").read_text() == cold.sha
    assert observer.progress[-1].done_bytes == observer.progress[-1].total_bytes
    assert observer.progress[-1].eta_s == 0.0

    hub.reset_stats()
    warm = fetch(hub, nas)
    assert warm.fetched_bytes == 0
    assert hub.bytes_served == 0
    assert hub.request_count == 0  # main is the commit the NAS holds; the manifest answers


def test_not_enough_space_fails_before_fetching_anything(
    hub: HubServer, nas: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = shutil.disk_usage(nas)
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage._replace(free=1 << 20))
    with pytest.raises(PrefetchError, match=f"needs 3.0 MiB .* more: {TINY} 3.0 MiB"):
        fetch(hub, nas)
    assert hub.bytes_served == 0
