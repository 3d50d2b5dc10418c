"""The step itself: every repo the plan names made complete in the NAS cache.

Per repo: what the revision is (one hub call, none for a pinned commit whose manifest still
matches), then under the repo's lock the files checked against the hub's list, the missing and
bad ones fetched (a file that arrives corrupt once more), and the manifest, the commit's file
list and the ref written. The free space for all of it is checked before anything is fetched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sparkdeploy.errors import PrefetchError
from sparkdeploy.steps.prefetch.cache import (
    FileOutcome,
    RepoOutcome,
    check_free_space,
    complete_outcome,
    missing_bytes,
    read_ref,
    remove_abandoned_partials,
    still_verified,
    storage_dir,
    write_manifest,
    write_ref,
    write_tree_cache,
)
from sparkdeploy.steps.prefetch.download import fetch_files
from sparkdeploy.steps.prefetch.hub import (
    HubAccess,
    HubFile,
    RepoLike,
    RepoSpec,
    check_token_transport,
)
from sparkdeploy.steps.prefetch.lock import repo_lock
from sparkdeploy.steps.prefetch.names import check_revision_name, is_commit_sha
from sparkdeploy.steps.prefetch.progress import Meter, PrefetchObserver, SilentObserver
from sparkdeploy.steps.prefetch.revision import hub_api, revision_files
from sparkdeploy.steps.prefetch.selection import ENGINE_SELECTION, FileSelection
from sparkdeploy.steps.prefetch.verify import check_files
from sparkdeploy.units import human_bytes


@dataclass
class _Pending:
    """A repo that is not known complete: its commit, its files and what is missing."""

    ref: RepoLike
    sha: str
    files: list[HubFile]
    missing_bytes: int


def prefetch(
    repos: Sequence[RepoLike],
    cache_dir: Path,
    hub: HubAccess,
    *,
    observer: PrefetchObserver | None = None,
    lock_wait_s: float = 6 * 3600.0,
    progress_interval_s: float = 1.0,
    update_revisions: bool = False,
    rehash: bool = False,
    selection: FileSelection = ENGINE_SELECTION,
) -> list[RepoOutcome]:
    """Make every repo complete in the HF cache at `cache_dir`; returns what each one holds.

    A branch or tag (an unpinned repo: `main`) is resolved once, when the repo first enters the
    cache: from then on it means the commit the cache's refs/<branch> names, without asking the
    hub, so a redeploy or a repair at night never pulls weights the hub's branch moved to since.
    `update_revisions` asks the hub for the branch's commit now (and says how far it moved).
    A repo whose manifest matches the disk costs no hub call; a cache another client filled
    (`hf download`, snapshot_download) is adopted by hashing each file once, fetching only what
    is missing or wrong. `rehash` hashes every file again, whatever the manifest says.
    Only the files `selection` takes are fetched (selection.py: by default what an engine
    reads). Raises TransientPrefetchError for failures worth retrying and PrefetchError for
    everything the operator must fix.
    """
    observer = observer or SilentObserver()
    if not cache_dir.is_dir():
        raise PrefetchError(
            f"NAS HF cache dir {cache_dir} does not exist on this host: mount the NAS there or fix "
            "[nas].hf_cache in the cluster inventory"
        )
    check_token_transport(hub)
    for ref in repos:
        check_revision_name(ref)
    api = hub_api(hub)

    outcomes: dict[tuple[str, str | None], RepoOutcome] = {}
    pending: list[_Pending] = []
    for ref in _unique(repos):
        files: list[HubFile] | None
        if ref.revision is not None and is_commit_sha(ref.revision):
            sha, files = ref.revision, None  # a pinned commit: the manifest may answer alone
        elif (held := read_ref(cache_dir, ref)) is not None and not update_revisions:
            sha, files = held, None
            observer.on_message(
                f"{ref.repo}@{ref.revision or 'main'}: commit {held[:12]}, as the NAS cache holds"
                " it since the repo entered it (the hub is not asked: deploy with"
                " update_revisions=true for the branch's newer commit)"
            )
        else:
            sha, files = revision_files(api, ref, hub, observer, selection=selection)
            if held is not None and held != sha:
                observer.on_message(
                    f"{ref.repo}@{ref.revision or 'main'} moved from {held[:12]} to {sha[:12]}"
                    " on the hub: fetching the new commit (update_revisions)"
                )
        complete = None if rehash else complete_outcome(cache_dir, ref, sha, selection)
        if complete is not None:
            write_ref(cache_dir, ref, sha)
            outcomes[(ref.repo, ref.revision)] = complete
            observer.on_message(
                f"{ref.repo}@{sha[:12]}: complete in the NAS cache "
                f"({len(complete.files)} files, {human_bytes(complete.total_bytes)})"
            )
            continue
        if files is None:
            _, files = revision_files(
                api, RepoSpec(ref.repo, sha), hub, observer, selection=selection
            )
        pending.append(_Pending(ref, sha, files, missing_bytes(cache_dir, ref.repo, sha, files)))

    check_free_space(cache_dir, {p.ref.repo: p.missing_bytes for p in pending})
    meter = Meter(sum(p.missing_bytes for p in pending), observer, progress_interval_s)
    for item in pending:
        outcome = _complete_repo(
            cache_dir, item, hub, observer, meter, lock_wait_s, rehash, selection
        )
        outcomes[(item.ref.repo, item.ref.revision)] = outcome
    return [outcomes[(ref.repo, ref.revision)] for ref in _unique(repos)]


def _unique(repos: Sequence[RepoLike]) -> list[RepoLike]:
    seen: dict[tuple[str, str | None], RepoLike] = {}
    for ref in repos:
        seen.setdefault((ref.repo, ref.revision), ref)
    return list(seen.values())


def _complete_repo(
    cache_dir: Path,
    item: _Pending,
    hub: HubAccess,
    observer: PrefetchObserver,
    meter: Meter,
    lock_wait_s: float,
    rehash: bool,
    selection: FileSelection,
) -> RepoOutcome:
    ref, sha = item.ref, item.sha
    storage = storage_dir(cache_dir, ref.repo)
    snapshot = storage / "snapshots" / sha
    reserved = item.missing_bytes
    with repo_lock(storage, ref.repo, wait_s=lock_wait_s, observer=observer):
        # Another flow may have completed the repo while this one waited for the lock.
        done_meanwhile = None if rehash else complete_outcome(cache_dir, ref, sha, selection)
        if done_meanwhile is not None:
            meter.retarget(-reserved)
            observer.on_message(f"{ref.repo}@{sha[:12]}: completed by another prefetch meanwhile")
            write_ref(cache_dir, ref, sha)
            return done_meanwhile
        remove_abandoned_partials(storage / "blobs", keep={f.blob_name for f in item.files})
        verified = {} if rehash else still_verified(cache_dir, ref.repo, sha)
        to_fetch = check_files(snapshot, item.files, verified, observer, ref.repo)
        fetched: set[str] = set()
        # A file that arrives corrupt is fetched once more; corrupt twice means the hub's copy is.
        for _attempt in range(2):
            if not to_fetch:
                break
            round_bytes = sum(f.size for f in to_fetch)
            meter.retarget(round_bytes - reserved)
            reserved = 0
            observer.on_message(
                f"{ref.repo}@{sha[:12]}: fetching {len(to_fetch)} of {len(item.files)} files, "
                f"{human_bytes(round_bytes)}"
            )
            with meter.watching(ref.repo, round_bytes):
                fetch_files(storage, ref, sha, to_fetch, hub, meter, observer, verified)
            fetched.update(f.path for f in to_fetch)
            to_fetch = check_files(snapshot, to_fetch, verified, observer, ref.repo)
        if to_fetch:
            raise PrefetchError(
                f"{ref.repo}@{sha}: the hub at {hub.endpoint} served "
                f"{', '.join(f.path for f in to_fetch)} twice with content that does not match "
                "the sha256/git oid in its tree listing: the hub's copy is corrupt; re-upload it"
            )
        meter.retarget(-reserved)
        write_manifest(cache_dir, ref.repo, sha, [verified[f.path] for f in item.files], selection)
        write_tree_cache(storage, sha, item.files)
        write_ref(cache_dir, ref, sha)
    files = tuple(
        FileOutcome(f.path, f.size, f.verification, fetched=f.path in fetched) for f in item.files
    )
    return RepoOutcome(ref.repo, ref.revision, sha, str(snapshot), files)
