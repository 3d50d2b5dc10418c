"""sparkdeploy.steps.prefetch.preview against the lab hub on loopback: what a prefetch would
do, said before it, byte for byte as the prefetch then counts it, and nothing written."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from huggingface_hub import snapshot_download
from prefetch_hub import TINY, fetch

from lab.hub.server import HubServer
from sparkdeploy.steps.prefetch import HubAccess, RepoSpec
from sparkdeploy.steps.prefetch.cache import manifest_path, storage_dir
from sparkdeploy.steps.prefetch.preview import RepoPreview, preview_repos

pytest_plugins = ["prefetch_fixtures"]


def _tree(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every entry under root: its size, mtime and (files) content digest, links as targets."""
    found = {}
    for directory, _dirs, files in os.walk(root):
        for name in [*_dirs, *files]:
            path = Path(directory) / name
            st = path.lstat()
            content = (
                os.readlink(path)
                if path.is_symlink()
                else hashlib.sha256(path.read_bytes()).hexdigest()
                if path.is_file()
                else ""
            )
            found[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns, content)
    return found


def _preview(hub: HubServer, nas: Path, *, update_revisions: bool = False) -> RepoPreview:
    before = _tree(nas)
    [found] = preview_repos(
        [RepoSpec(TINY)],
        nas,
        HubAccess(hub.url, allow_http_token=True),
        update_revisions=update_revisions,
    )
    assert _tree(nas) == before  # read-only: not a file, link, dir or mtime changed
    return found


def test_a_cold_nas_previews_the_download_the_prefetch_then_makes(
    hub: HubServer, nas: Path
) -> None:
    cold = _preview(hub, nas)
    assert hub.bytes_served == 0  # the preview asks for the listing, never a file
    outcome = fetch(hub, nas)
    assert (cold.action, cold.sha) == ("download", outcome.sha)
    assert cold.download_bytes == outcome.fetched_bytes == outcome.total_bytes == cold.total_bytes

    warm = _preview(hub, nas)
    assert (warm.action, warm.download_bytes, warm.hash_bytes) == ("complete", 0, 0)
    assert "main has not moved on the hub" in warm.detail
    assert fetch(hub, nas).fetched_bytes == 0


def test_a_cache_another_client_filled_previews_as_adopted_by_hashing(
    hub: HubServer, nas: Path
) -> None:
    snapshot_download(TINY, cache_dir=nas, endpoint=hub.url, token=False)
    found = _preview(hub, nas)
    outcome = fetch(hub, nas)
    assert (found.action, found.download_bytes) == ("adopt", outcome.fetched_bytes) == ("adopt", 0)
    assert found.hash_bytes == outcome.total_bytes
    assert f"hash {len(outcome.files)} files" in found.detail


def test_a_partly_fetched_repo_previews_the_missing_files_only(hub: HubServer, nas: Path) -> None:
    outcome = fetch(hub, nas)
    manifest_path(nas, TINY, outcome.sha).unlink()
    lost = next(f for f in outcome.files if f.path.endswith(".safetensors"))
    (Path(outcome.snapshot_dir) / lost.path).unlink()
    found = _preview(hub, nas)
    again = fetch(hub, nas)
    assert found.action == "download"
    assert found.download_bytes == again.fetched_bytes == lost.size
    assert found.hash_bytes == outcome.total_bytes - lost.size
    assert "linked" in found.detail  # its blob is still there: linked, not downloaded


def test_a_branch_that_moved_is_named_with_what_update_revisions_would_take(
    hub: HubServer, nas: Path, repos_dir: Path
) -> None:
    first = fetch(hub, nas)
    (repos_dir / TINY / "original").mkdir()
    (repos_dir / TINY / "original" / "consolidated.safetensors").write_bytes(b"\0" * 4096)
    kept = _preview(hub, nas)
    assert (kept.action, kept.sha) == ("complete", first.sha)
    assert f"main moved from {first.sha[:12]} to " in kept.detail
    assert "update_revisions=true" in kept.detail

    moving = _preview(hub, nas, update_revisions=True)
    moved = fetch(hub, nas, update_revisions=True)
    assert moving.sha == moved.sha != first.sha
    assert moving.download_bytes == moved.fetched_bytes


def test_an_unreachable_hub_is_unknown_where_it_matters(hub: HubServer, nas: Path) -> None:
    down = HubAccess("http://127.0.0.1:9", allow_http_token=True)
    [cold] = preview_repos([RepoSpec(TINY)], nas, down)
    assert cold.action == "unknown"
    assert "did not answer" in cold.detail
    fetch(hub, nas)
    [warm] = preview_repos([RepoSpec(TINY)], nas, down)
    assert warm.action == "complete"
    assert "whether main moved on the hub is unknown" in warm.detail


def test_a_prefetch_holding_the_repo_is_named(hub: HubServer, nas: Path) -> None:
    lock = storage_dir(nas, TINY) / ".sparkdeploy" / "prefetch.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text('{"host": "ops1", "pid": 42}')
    found = _preview(hub, nas)
    assert 'another prefetch holds the repo now ({"host": "ops1", "pid": 42})' in found.detail
