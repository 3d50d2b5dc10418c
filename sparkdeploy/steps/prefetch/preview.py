"""What a prefetch would do now, per repo, read without writing anything.

The same decisions as complete.prefetch(), from the same reads (refs/<branch>, the manifest, one
stat per file, the hub's listing), and nothing that writes: no lock is taken (a lock file is only
read, to say who holds it), no ref, manifest, tree cache or partial file is written or removed,
and the hub is only asked for listings. A repo is:

- complete: its manifest matches the disk (0 bytes to fetch);
- adopt: its files are there (another client filled the cache) and are hashed once; a file whose
  hash then does not match is fetched, which no preview can tell without hashing it;
- download: files missing or of the wrong size are fetched (a blob another commit holds already
  is linked, and a partial file resumed, but the prefetch reports them fetched all the same);
- unknown: the hub did not answer where the answer is needed;
- refuse: what the prefetch would refuse (a bad revision name, a gated or missing repo, too
  little space on the NAS).

For an unpinned repo the NAS holds, the prefetch keeps the commit refs/<branch> names; the
preview asks the hub anyway whether the branch moved, to say what update_revisions would take.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from huggingface_hub import HfApi

from sparkdeploy.errors import PrefetchError, TransientPrefetchError
from sparkdeploy.steps.prefetch.cache import (
    MANIFEST_DIRNAME,
    PARTIAL_SUFFIX,
    complete_outcome,
    missing_bytes,
    read_ref,
    still_verified,
    storage_dir,
)
from sparkdeploy.steps.prefetch.hub import (
    HubAccess,
    HubFile,
    RepoLike,
    RepoSpec,
    check_token_transport,
)
from sparkdeploy.steps.prefetch.lock import LOCK_FILENAME
from sparkdeploy.steps.prefetch.names import check_revision_name, is_commit_sha
from sparkdeploy.steps.prefetch.progress import SilentObserver
from sparkdeploy.steps.prefetch.revision import hub_api, revision_files
from sparkdeploy.steps.prefetch.selection import ENGINE_SELECTION, FileSelection
from sparkdeploy.units import human_bytes

RepoAction = Literal["complete", "adopt", "download", "unknown", "refuse"]
# A preview does not wait out a rate limit, nor a hub that is slow to answer: it says unknown.
PREVIEW_REQUEST_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class RepoPreview:
    """What the prefetch would do to one repo (bytes as its RepoOutcome would count them)."""

    repo: str
    revision: str | None
    sha: str | None  # the commit it would hold (None: unknown)
    action: RepoAction
    download_bytes: int  # the files it would fetch (RepoOutcome.fetched_bytes)
    hash_bytes: int  # the files it would hash once before it trusts them
    total_bytes: int | None  # the revision's files (None: unknown)
    detail: str


def preview_repos(
    repos: Sequence[RepoLike],
    cache_dir: Path,
    hub: HubAccess,
    *,
    update_revisions: bool = False,
    selection: FileSelection = ENGINE_SELECTION,
) -> list[RepoPreview]:
    """What prefetch(repos, cache_dir, hub, update_revisions=..., selection=...) would do to
    each repo now, in its order; reads only (module docstring)."""
    unique: dict[tuple[str, str | None], RepoLike] = {}
    for ref in repos:
        unique.setdefault((ref.repo, ref.revision), ref)
    if not cache_dir.is_dir():
        why = (
            f"NAS HF cache dir {cache_dir} does not exist on this host: mount the NAS there or fix"
            " [nas].hf_cache in the cluster inventory"
        )
        return [_refused(ref, None, why) for ref in unique.values()]
    try:
        check_token_transport(hub)
    except PrefetchError as error:
        return [_refused(ref, None, str(error)) for ref in unique.values()]
    quick = replace(
        hub,
        request_timeout_s=min(hub.request_timeout_s, PREVIEW_REQUEST_TIMEOUT_S),
        max_retry_after_s=0.0,
        download_attempts=1,
    )
    api = hub_api(quick)
    previews = [
        _preview_repo(api, ref, cache_dir, quick, update_revisions, selection)
        for ref in unique.values()
    ]
    return _with_space_check(previews, cache_dir)


def _preview_repo(
    api: HfApi,
    ref: RepoLike,
    cache_dir: Path,
    hub: HubAccess,
    update_revisions: bool,
    selection: FileSelection,
) -> RepoPreview:
    try:
        check_revision_name(ref)
    except PrefetchError as error:
        return _refused(ref, None, str(error))
    branch = ref.revision or "main"
    notes: list[str] = []
    files: list[HubFile] | None = None
    held = None if ref.revision and is_commit_sha(ref.revision) else read_ref(cache_dir, ref)
    if ref.revision is not None and is_commit_sha(ref.revision):
        sha = ref.revision
    elif held is not None and not update_revisions:
        sha = held
        notes.append(f"{branch} at {held[:12]}, as the NAS holds it")
        notes.append(_moved_note(api, ref, hub, cache_dir, held, selection))
    else:
        try:
            sha, files = revision_files(api, ref, hub, SilentObserver(), selection=selection)
        except TransientPrefetchError as error:
            return _unknown(ref, f"the hub did not answer for {branch}: {error}")
        except PrefetchError as error:
            return _refused(ref, None, str(error))
        if held is not None and held != sha:
            notes.append(f"{branch} moved from {held[:12]} to {sha[:12]}: the new commit is taken")
    complete = complete_outcome(cache_dir, ref, sha, selection)
    if complete is not None:
        notes.insert(0, f"complete ({len(complete.files)} files, 0 B to fetch)")
        return RepoPreview(
            ref.repo, ref.revision, sha, "complete", 0, 0, complete.total_bytes, "; ".join(notes)
        )
    if files is None:
        try:
            _, files = revision_files(
                api, RepoSpec(ref.repo, sha), hub, SilentObserver(), selection=selection
            )
        except TransientPrefetchError as error:
            return _unknown(
                ref, f"not complete in the NAS, and the hub did not answer: {error}", sha
            )
        except PrefetchError as error:
            return _refused(ref, sha, str(error))
    return _pending(ref, sha, files, cache_dir, notes)


def _pending(
    ref: RepoLike, sha: str, files: list[HubFile], cache_dir: Path, notes: list[str]
) -> RepoPreview:
    """A repo that is not known complete: what check_files would hash, and what it would fetch."""
    storage = storage_dir(cache_dir, ref.repo)
    snapshot = storage / "snapshots" / sha
    verified = still_verified(cache_dir, ref.repo, sha)
    to_hash: list[HubFile] = []
    to_fetch: list[HubFile] = []
    for f in files:
        if f.path in verified:
            continue
        try:
            size = (snapshot / f.path).stat().st_size
        except FileNotFoundError:
            to_fetch.append(f)
            continue
        (to_hash if size == f.size else to_fetch).append(f)
    download = sum(f.size for f in to_fetch)
    hashed = sum(f.size for f in to_hash)
    total = sum(f.size for f in files)
    parts = []
    if to_hash:
        parts.append(
            f"adopt: hash {len(to_hash)} files, {human_bytes(hashed)} ({hashed} B), once (a file"
            " that does not match is fetched again)"
        )
    if to_fetch:
        linked, resumed = _on_disk_already(storage / "blobs", to_fetch)
        extra = []
        if linked:
            extra.append(f"{human_bytes(linked)} of it in blobs another commit holds: linked")
        if resumed:
            extra.append(f"{human_bytes(resumed)} in partial files: resumed")
        parts.append(
            f"download {len(to_fetch)} of {len(files)} files, {human_bytes(download)}"
            f" ({download} B)" + (f" ({'; '.join(extra)})" if extra else "")
        )
    if not parts:
        parts.append(f"every file verified; the manifest is written ({len(files)} files)")
    holder = _lock_holder(storage)
    if holder:
        parts.append(f"another prefetch holds the repo now ({holder}): the deploy waits for it")
    action: RepoAction = "download" if to_fetch else "adopt"
    return RepoPreview(
        ref.repo, ref.revision, sha, action, download, hashed, total, "; ".join(parts + notes)
    )


def _moved_note(
    api: HfApi,
    ref: RepoLike,
    hub: HubAccess,
    cache_dir: Path,
    held: str,
    selection: FileSelection,
) -> str:
    """Whether the branch moved on the hub since the NAS took it (the hub is only read)."""
    branch = ref.revision or "main"
    try:
        sha, files = revision_files(api, ref, hub, SilentObserver(), selection=selection)
    except PrefetchError as error:
        return f"whether {branch} moved on the hub is unknown ({error})"
    if sha == held:
        return f"{branch} has not moved on the hub"
    more = missing_bytes(cache_dir, ref.repo, sha, files)
    # As the prefetch would: a file whose blob another commit holds is linked, not downloaded.
    storage = storage_dir(cache_dir, ref.repo)
    snapshot = storage / "snapshots" / sha
    linked, resumed = _on_disk_already(
        storage / "blobs", [f for f in files if not _whole(snapshot / f.path, f.size)]
    )
    from_hub = more - linked - resumed
    how = f"{human_bytes(more)} ({more} B) more"
    if from_hub != more:
        on_disk = [f"{human_bytes(linked)} in blobs another commit holds: linked"] if linked else []
        on_disk += [f"{human_bytes(resumed)} in partial files: resumed"] if resumed else []
        how += f", {human_bytes(from_hub)} ({from_hub} B) of it from the hub ({'; '.join(on_disk)})"
    return (
        f"{branch} moved from {held[:12]} to {sha[:12]}: {how} (deploy with"
        " update_revisions=true to take it)"
    )


def _whole(path: Path, size: int) -> bool:
    """The snapshot holds the file at its size already (cache.missing_bytes's test)."""
    try:
        return path.stat().st_size == size
    except FileNotFoundError:
        return False


def _on_disk_already(blobs: Path, files: Sequence[HubFile]) -> tuple[int, int]:
    """(bytes of files whose blob is there whole, bytes of partial files the download resumes)."""
    linked = resumed = 0
    for f in files:
        blob = blobs / f.blob_name
        with contextlib.suppress(FileNotFoundError):
            if blob.stat().st_size == f.size:
                linked += f.size
                continue
        with contextlib.suppress(FileNotFoundError):
            partial = (blobs / (f.blob_name + PARTIAL_SUFFIX)).stat().st_size
            resumed += partial if partial < f.size else 0
    return linked, resumed


def _lock_holder(storage: Path) -> str:
    """Who holds the repo's prefetch lock, as the holder wrote it ("" when free): the file is
    read, never opened for writing or locked."""
    try:
        return (storage / MANIFEST_DIRNAME / LOCK_FILENAME).read_text(errors="replace").strip()
    except (FileNotFoundError, NotADirectoryError):
        return ""


def _with_space_check(previews: list[RepoPreview], cache_dir: Path) -> list[RepoPreview]:
    """The prefetch's free-space check (cache.check_free_space) on what would be fetched: each
    repo with bytes to fetch refused, with the figures, when they do not fit together."""
    needed = sum(p.download_bytes for p in previews)
    free = shutil.disk_usage(cache_dir).free
    if needed <= free:
        return previews
    why = (
        f"the NAS HF cache {cache_dir} has {human_bytes(free)} ({free} B) free but the prefetch"
        f" needs {human_bytes(needed)} ({needed} B) more: free space on the NAS"
    )
    return [
        replace(p, action="refuse", detail=f"{why}; {p.detail}") if p.download_bytes else p
        for p in previews
    ]


def _refused(ref: RepoLike, sha: str | None, why: str) -> RepoPreview:
    return RepoPreview(ref.repo, ref.revision, sha, "refuse", 0, 0, None, why)


def _unknown(ref: RepoLike, why: str, sha: str | None = None) -> RepoPreview:
    return RepoPreview(ref.repo, ref.revision, sha, "unknown", 0, 0, None, why)
