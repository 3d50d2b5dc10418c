"""Prefetch of hub repos into the NAS HF cache: fetched and verified once, recognised instantly.

huggingface_hub answers what a revision is: its commit sha and its files with size, git oid and
LFS sha256. The bytes are moved by sparkdeploy.remote.blobfetch (http.client threads, resumable
partial files, hashed while written; the hub's redirects to its storage host followed without the
token) into the cache layout huggingface_hub itself writes and reads
offline: `models--org--name/blobs/<sha256 or git oid>`, `snapshots/<sha>/<path>` as relative
symlinks to the blobs, `refs/<branch>`. Around that this module adds what a shared NAS cache
needs: a free-space check before anything is fetched, a per-repo lock so two flows never download
the same repo at once, a sha256 (LFS) or git-oid (small files) check of every file once, and a
manifest per commit, `models--org--name/.sparkdeploy/<sha>.json`, that records each file's size
and the inode and mtime it had when verified. A repo whose manifest still matches the disk is
complete: that check is one stat per file and never reads file data.

The hub's refusals are named from its X-Error-Code (GatedRepo, RepoNotFound, RevisionNotFound,
EntryNotFound) with what to do, and never retried; a 429 or 503 that says how long to wait
(Retry-After) is waited for in place, up to HubAccess.max_retry_after_s (docs/field.md, "The
Hugging Face hub").
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import quote

import httpx2
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.hf_api import ModelInfo

from sparkdeploy.errors import PrefetchError, TransientPrefetchError
from sparkdeploy.remote import blobfetch
from sparkdeploy.remote.hf_tree_cache import TreeFile, write_commit_files
from sparkdeploy.units import human_bytes

PUBLIC_HUB = "https://huggingface.co"
TOKEN_SECRET_BLOCK = "hf-token"
# Where a token can come from, as the operator sets it (tasks.prefetch reads them in this order).
TOKEN_SOURCES = f"the Prefect Secret block '{TOKEN_SECRET_BLOCK}' or HF_TOKEN"
# The hub's answer to a token that is no token of its own (revoked, mistyped).
_INVALID_TOKEN_MESSAGE = "Invalid credentials in Authorization header"
MANIFEST_DIRNAME = ".sparkdeploy"
MANIFEST_VERSION = 1
LOCK_FILENAME = "prefetch.lock"
PARTIAL_SUFFIX = ".incomplete"

_COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
# A partial file that is not one of this revision's blobs (another revision's, or one a
# huggingface_hub client named per process) and untouched this long belongs to a download that
# died; we hold the repo lock, so it is safe to remove.
_ABANDONED_PARTIAL_AGE_S = 600.0

Verification = Literal["sha256", "git-sha1"]


class RepoLike(Protocol):
    """Anything naming a repo and an optional revision (plan.RepoRef, RepoSpec)."""

    @property
    def repo(self) -> str: ...

    @property
    def revision(self) -> str | None: ...


@dataclass(frozen=True)
class RepoSpec:
    repo: str
    revision: str | None = None


@dataclass(frozen=True)
class HubAccess:
    """Where the hub is and how to talk to it. The token stays out of repr, so out of logs;
    token_source says where it came from, for the errors that are about it."""

    endpoint: str = field(default_factory=lambda: os.environ.get("HF_ENDPOINT") or PUBLIC_HUB)
    token: str | None = field(default=None, repr=False)
    token_source: str = TOKEN_SOURCES
    max_workers: int = 8
    # Bounds the revision lookup, and each connect and read of a download (not the whole file).
    request_timeout_s: float = 60.0
    # Tries per file for a transient failure (reset, timeout, cut, 5xx), each resuming where
    # the last one stopped, the waits doubling from retry_backoff_s.
    download_attempts: int = 5
    retry_backoff_s: float = 1.0
    # The longest wait a Retry-After (429 rate limit, 503) gets in place; a longer one fails the
    # call as transient, for the task's own retry. The hub's rate-limit window is 5 minutes.
    max_retry_after_s: float = 300.0


@dataclass(frozen=True)
class Progress:
    """Bytes of the whole prefetch call, and the repo being fetched now."""

    repo: str
    done_bytes: int
    total_bytes: int
    rate_bps: float
    eta_s: float | None


class PrefetchObserver(Protocol):
    def on_progress(self, progress: Progress) -> None: ...

    def on_message(self, message: str) -> None: ...


class SilentObserver:
    def on_progress(self, progress: Progress) -> None:
        pass

    def on_message(self, message: str) -> None:
        pass


@dataclass(frozen=True)
class FileOutcome:
    path: str
    size: int
    verified: Verification
    fetched: bool


@dataclass(frozen=True)
class RepoOutcome:
    repo: str
    revision: str | None
    sha: str
    snapshot_dir: str
    files: tuple[FileOutcome, ...]

    @property
    def fetched_bytes(self) -> int:
        return sum(f.size for f in self.files if f.fetched)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class _HubFile:
    path: str
    size: int
    blob_id: str
    lfs_sha256: str | None

    @property
    def verification(self) -> Verification:
        return "sha256" if self.lfs_sha256 is not None else "git-sha1"

    @property
    def expected_digest(self) -> str:
        return self.lfs_sha256 if self.lfs_sha256 is not None else self.blob_id

    @property
    def blob_name(self) -> str:
        """Its name under blobs/, as huggingface_hub names it: the ETag the hub serves it with."""
        return self.expected_digest

    def new_digest(self) -> Any:
        """A hashlib object that, fed the file's bytes, gives expected_digest if they are right."""
        if self.lfs_sha256 is not None:
            return hashlib.sha256()
        return blobfetch.new_digest("sha1", _git_blob_header(self.size))()


@dataclass
class _Pending:
    """A repo that is not known complete: its commit, its files and what is missing."""

    ref: RepoLike
    sha: str
    files: list[_HubFile]
    missing_bytes: int


def storage_dir(cache_dir: Path, repo: str) -> Path:
    return cache_dir / repo_folder_name(repo_id=repo, repo_type="model")


def manifest_path(cache_dir: Path, repo: str, sha: str) -> Path:
    return storage_dir(cache_dir, repo) / MANIFEST_DIRNAME / f"{sha}.json"


def prefetch(
    repos: Sequence[RepoLike],
    cache_dir: Path,
    hub: HubAccess,
    *,
    observer: PrefetchObserver | None = None,
    lock_wait_s: float = 6 * 3600.0,
    progress_interval_s: float = 1.0,
) -> list[RepoOutcome]:
    """Make every repo complete in the HF cache at `cache_dir`; returns what each one holds.

    Idempotent: a repo whose manifest matches the disk costs at most one hub call (none when the
    revision is a commit sha). Raises TransientPrefetchError for failures worth retrying and
    PrefetchError for everything the operator must fix.
    """
    observer = observer or SilentObserver()
    if not cache_dir.is_dir():
        raise PrefetchError(
            f"NAS HF cache dir {cache_dir} does not exist on this host: mount the NAS there or fix "
            "[nas].hf_cache in the cluster inventory"
        )
    api = HfApi(endpoint=hub.endpoint, token=_token_argument(hub))

    outcomes: dict[tuple[str, str | None], RepoOutcome] = {}
    pending: list[_Pending] = []
    for ref in _unique(repos):
        if ref.revision is not None and _COMMIT_SHA.fullmatch(ref.revision):
            sha, files = ref.revision, None  # a pinned commit: the manifest may answer alone
        else:
            sha, files = _revision_files(api, ref, hub, observer)
        complete = _complete_outcome(cache_dir, ref, sha)
        if complete is not None:
            _write_ref(cache_dir, ref, sha)
            outcomes[(ref.repo, ref.revision)] = complete
            observer.on_message(
                f"{ref.repo}@{sha[:12]}: complete in the NAS cache "
                f"({len(complete.files)} files, {human_bytes(complete.total_bytes)})"
            )
            continue
        if files is None:
            _, files = _revision_files(api, ref, hub, observer)
        pending.append(_Pending(ref, sha, files, _missing_bytes(cache_dir, ref.repo, sha, files)))

    check_free_space(cache_dir, {p.ref.repo: p.missing_bytes for p in pending})
    meter = _Meter(sum(p.missing_bytes for p in pending), observer, progress_interval_s)
    for item in pending:
        outcome = _complete_repo(cache_dir, item, hub, observer, meter, lock_wait_s)
        outcomes[(item.ref.repo, item.ref.revision)] = outcome
    return [outcomes[(ref.repo, ref.revision)] for ref in _unique(repos)]


def check_free_space(cache_dir: Path, missing_bytes: dict[str, int]) -> None:
    needed = sum(missing_bytes.values())
    free = shutil.disk_usage(cache_dir).free
    if needed > free:
        detail = ", ".join(f"{repo} {human_bytes(n)}" for repo, n in missing_bytes.items() if n)
        raise PrefetchError(
            f"NAS HF cache {cache_dir} has {human_bytes(free)} ({free} bytes) free but the "
            f"prefetch needs {human_bytes(needed)} ({needed} bytes) more: {detail}. Free space on "
            "the NAS (e.g. `hf cache rm` old revisions) or prefetch fewer repos"
        )


def _unique(repos: Sequence[RepoLike]) -> list[RepoLike]:
    seen: dict[tuple[str, str | None], RepoLike] = {}
    for ref in repos:
        seen.setdefault((ref.repo, ref.revision), ref)
    return list(seen.values())


def _token_argument(hub: HubAccess) -> str | bool:
    # False, not None: None would make huggingface_hub pick up a token from the environment or
    # ~/.cache/huggingface on its own, and the caller decides where the token comes from.
    return hub.token if hub.token else False


def _revision_files(
    api: HfApi, ref: RepoLike, hub: HubAccess, observer: PrefetchObserver
) -> tuple[str, list[_HubFile]]:
    """The revision's commit sha and its files, from one hub call (so the two agree)."""
    info = _model_info(api, ref, hub, observer)
    not_a_hub = (
        f"the hub at {hub.endpoint} returned no commit sha or no file sizes and oids for "
        f"{ref.repo}@{ref.revision or 'main'}: is HF_ENDPOINT a Hugging Face hub?"
    )
    if not info.sha:
        raise PrefetchError(not_a_hub)
    files: list[_HubFile] = []
    for sibling in info.siblings or []:
        if sibling.size is None or sibling.blob_id is None:
            raise PrefetchError(not_a_hub)
        lfs_sha256 = sibling.lfs.sha256 if sibling.lfs is not None else None
        files.append(_HubFile(sibling.rfilename, sibling.size, sibling.blob_id, lfs_sha256))
    return info.sha, files


def _model_info(api: HfApi, ref: RepoLike, hub: HubAccess, observer: PrefetchObserver) -> ModelInfo:
    """The revision's info, asked again after the wait the hub's Retry-After asks for (a rate
    limit), up to hub.download_attempts times; any other failure is raised at once."""
    attempt = 1
    while True:
        try:
            with _hub_errors(ref, hub):
                return api.model_info(
                    ref.repo,
                    revision=ref.revision,
                    files_metadata=True,
                    timeout=hub.request_timeout_s,
                )
        except TransientPrefetchError as exc:
            wait = exc.retry_after_s
            if wait is None or wait > hub.max_retry_after_s or attempt >= hub.download_attempts:
                raise
            attempt += 1
            observer.on_message(
                f"{exc}; waiting the {wait:.0f} s its Retry-After asks for, then asking again"
                f" (attempt {attempt} of {hub.download_attempts})"
            )
            time.sleep(wait)


def _complete_outcome(cache_dir: Path, ref: RepoLike, sha: str) -> RepoOutcome | None:
    """The repo's outcome if its manifest exists and every file still has the recorded identity."""
    entries = _read_manifest(cache_dir, ref.repo, sha)
    if entries is None:
        return None
    snapshot = storage_dir(cache_dir, ref.repo) / "snapshots" / sha
    for entry in entries.values():
        if not _identity_matches(snapshot / entry["path"], entry):
            return None
    files = tuple(
        FileOutcome(e["path"], e["size"], e["verified"], fetched=False) for e in entries.values()
    )
    return RepoOutcome(ref.repo, ref.revision, sha, str(snapshot), files)


def _read_manifest(cache_dir: Path, repo: str, sha: str) -> dict[str, dict[str, Any]] | None:
    try:
        data = json.loads(manifest_path(cache_dir, repo, sha).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if data.get("version") != MANIFEST_VERSION or data.get("sha") != sha:
        return None
    return {entry["path"]: entry for entry in data["files"]}


def _identity_matches(pointer: Path, entry: dict[str, Any]) -> bool:
    try:
        st = pointer.stat()
    except FileNotFoundError:
        return False
    return bool(
        st.st_size == entry["size"]
        and st.st_ino == entry["ino"]
        and st.st_mtime_ns == entry["mtime_ns"]
    )


def _missing_bytes(cache_dir: Path, repo: str, sha: str, files: list[_HubFile]) -> int:
    snapshot = storage_dir(cache_dir, repo) / "snapshots" / sha
    missing = 0
    for f in files:
        try:
            present = (snapshot / f.path).stat().st_size == f.size
        except FileNotFoundError:
            present = False
        missing += 0 if present else f.size
    return missing


def _complete_repo(
    cache_dir: Path,
    item: _Pending,
    hub: HubAccess,
    observer: PrefetchObserver,
    meter: _Meter,
    lock_wait_s: float,
) -> RepoOutcome:
    ref, sha = item.ref, item.sha
    storage = storage_dir(cache_dir, ref.repo)
    snapshot = storage / "snapshots" / sha
    reserved = item.missing_bytes
    with repo_lock(storage, ref.repo, wait_s=lock_wait_s, observer=observer):
        # Another flow may have completed the repo while this one waited for the lock.
        done_meanwhile = _complete_outcome(cache_dir, ref, sha)
        if done_meanwhile is not None:
            meter.retarget(-reserved)
            observer.on_message(f"{ref.repo}@{sha[:12]}: completed by another prefetch meanwhile")
            _write_ref(cache_dir, ref, sha)
            return done_meanwhile
        _remove_abandoned_partials(storage / "blobs", keep={f.blob_name for f in item.files})
        verified = {
            path: entry
            for path, entry in (_read_manifest(cache_dir, ref.repo, sha) or {}).items()
            if _identity_matches(snapshot / path, entry)
        }
        to_fetch = _check_files(snapshot, item.files, verified, observer, ref.repo)
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
                _fetch_files(storage, ref, sha, to_fetch, hub, meter, observer, verified)
            fetched.update(f.path for f in to_fetch)
            to_fetch = _check_files(snapshot, to_fetch, verified, observer, ref.repo)
        if to_fetch:
            raise PrefetchError(
                f"{ref.repo}@{sha}: the hub at {hub.endpoint} served "
                f"{', '.join(f.path for f in to_fetch)} twice with content that does not match "
                "the sha256/git oid in its tree listing: the hub's copy is corrupt; re-upload it"
            )
        meter.retarget(-reserved)
        _write_manifest(cache_dir, ref.repo, sha, [verified[f.path] for f in item.files])
        _write_tree_cache(storage, sha, item.files)
        _write_ref(cache_dir, ref, sha)
    files = tuple(
        FileOutcome(f.path, f.size, f.verification, fetched=f.path in fetched) for f in item.files
    )
    return RepoOutcome(ref.repo, ref.revision, sha, str(snapshot), files)


def _check_files(
    snapshot: Path,
    files: Sequence[_HubFile],
    verified: dict[str, dict[str, Any]],
    observer: PrefetchObserver,
    repo: str,
) -> list[_HubFile]:
    """Verify the present, not yet verified files; remove bad ones. Returns what must be fetched.

    Verified files are added to `verified` with the identity they had when hashed.
    """
    to_hash: list[_HubFile] = []
    to_fetch: list[_HubFile] = []
    for f in files:
        if f.path in verified:
            continue
        pointer = snapshot / f.path
        try:
            size = pointer.stat().st_size
        except FileNotFoundError:
            pointer.unlink(missing_ok=True)  # a dangling symlink would be taken for a cached file
            to_fetch.append(f)
            continue
        if size == f.size:
            to_hash.append(f)
        else:
            observer.on_message(
                f"{repo}: {f.path} has {size} bytes, the hub says {f.size}: removed, fetching again"
            )
            _remove_file(pointer)
            to_fetch.append(f)
    if to_hash:
        observer.on_message(
            f"{repo}: verifying {len(to_hash)} files, {human_bytes(sum(f.size for f in to_hash))}"
        )
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prefetch-verify") as pool:
        entries = list(pool.map(lambda f: _verified_entry(snapshot / f.path, f), to_hash))
    for f, entry in zip(to_hash, entries, strict=True):
        if entry is not None:
            verified[f.path] = entry
            continue
        observer.on_message(
            f"{repo}: {f.path} does not match its {f.verification} {f.expected_digest}: "
            "removed, fetching again"
        )
        _remove_file(snapshot / f.path)
        to_fetch.append(f)
    return to_fetch


def _verified_entry(pointer: Path, f: _HubFile) -> dict[str, Any] | None:
    """The manifest entry of `pointer` if its content matches the hub's digest, else None."""
    digest = f.new_digest()
    blobfetch.hash_file(digest, pointer)
    return _manifest_entry(pointer, f) if digest.hexdigest() == f.expected_digest else None


def _manifest_entry(pointer: Path, f: _HubFile) -> dict[str, Any]:
    """What the manifest remembers of a verified file: the identity it has now."""
    st = pointer.stat()
    return {
        "path": f.path,
        "size": f.size,
        "verified": f.verification,
        "digest": f.expected_digest,
        "ino": st.st_ino,
        "mtime_ns": st.st_mtime_ns,
    }


def _git_blob_header(size: int) -> bytes:
    return b"blob %d\0" % size


def _remove_file(pointer: Path) -> None:
    """Remove a snapshot entry and, when it is a symlink, the blob it points to."""
    if pointer.is_symlink():
        pointer.resolve().unlink(missing_ok=True)
    pointer.unlink(missing_ok=True)


def _remove_abandoned_partials(blobs: Path, keep: set[str]) -> None:
    """Remove old partial files except this revision's own, which the download resumes."""
    if not blobs.is_dir():
        return
    now = time.time()
    for partial in blobs.glob(f"*{PARTIAL_SUFFIX}"):
        if partial.name.removesuffix(PARTIAL_SUFFIX) in keep:
            continue
        with contextlib.suppress(FileNotFoundError):
            if now - partial.stat().st_mtime > _ABANDONED_PARTIAL_AGE_S:
                partial.unlink()


def _fetch_files(
    storage: Path,
    ref: RepoLike,
    sha: str,
    files: Sequence[_HubFile],
    hub: HubAccess,
    meter: _Meter,
    observer: PrefetchObserver,
    verified: dict[str, dict[str, Any]],
) -> None:
    """Download `files` over hub.max_workers connections into blobs/ and the snapshot.

    What arrives with the right digest is added to `verified`; a file that arrives corrupt, or
    whose blob was already present, is left for _check_files to judge.
    """
    queue = collections.deque(sorted(files, key=lambda f: f.size, reverse=True))
    stop = threading.Event()

    def worker() -> None:
        with blobfetch.Connections(
            timeout_s=hub.request_timeout_s,
            token=hub.token,
            token_origin=blobfetch.origin_of(hub.endpoint),
        ) as connections:
            while not stop.is_set():
                try:
                    f = queue.popleft()
                except IndexError:
                    return
                try:
                    entry = _fetch_file(connections, storage, ref, sha, f, hub, meter, observer)
                except BaseException:
                    stop.set()  # the others finish the file they are on, and take no other
                    raise
                if entry is not None:
                    verified[f.path] = entry

    workers = max(1, min(hub.max_workers, len(files)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prefetch-fetch") as pool:
        # Each worker runs in a copy of this context, so its log lines keep the Prefect run's.
        futures = [pool.submit(contextvars.copy_context().run, worker) for _ in range(workers)]
    errors = [exc for exc in (future.exception() for future in futures) if exc is not None]
    if errors:
        # An error no retry can fix outranks a transient one: the operator must act on it.
        raise min(errors, key=lambda exc: isinstance(exc, TransientPrefetchError))


def _fetch_file(
    connections: blobfetch.Connections,
    storage: Path,
    ref: RepoLike,
    sha: str,
    f: _HubFile,
    hub: HubAccess,
    meter: _Meter,
    observer: PrefetchObserver,
) -> dict[str, Any] | None:
    """Put `f` into blobs/ and link it from the snapshot; its manifest entry if verified here."""
    blob = storage / "blobs" / f.blob_name
    pointer = storage / "snapshots" / sha / f.path
    with contextlib.suppress(FileNotFoundError):
        if blob.stat().st_size == f.size:
            _link(pointer, blob)  # another revision's blob, or a link lost: _check_files hashes it
            return None
        blob.unlink()
    blob.parent.mkdir(parents=True, exist_ok=True)
    partial = blob.with_name(blob.name + PARTIAL_SUFFIX)
    url = f"{hub.endpoint.rstrip('/')}/{ref.repo}/resolve/{sha}/{quote(f.path)}"
    where = f"{ref.repo}@{sha[:12]}: {f.path}"
    with contextlib.suppress(FileNotFoundError):
        if (resumed := partial.stat().st_size) and resumed < f.size:
            observer.on_message(f"{where}: resuming from byte {resumed} of {f.size}")

    def on_retry(reason: str, offset: int, delay_s: float) -> None:
        observer.on_message(f"{where}: {reason}; retrying from byte {offset} in {delay_s:.0f} s")

    def remove_empty_partial() -> None:
        with contextlib.suppress(FileNotFoundError):
            if partial.stat().st_size == 0:
                partial.unlink()

    try:
        digest = blobfetch.fetch(
            connections,
            url,
            partial,
            size=f.size,
            new_digest=f.new_digest,
            attempts=hub.download_attempts,
            backoff_s=hub.retry_backoff_s,
            max_retry_after_s=hub.max_retry_after_s,
            on_bytes=meter.add,
            on_retry=on_retry,
        )
    except blobfetch.HttpStatusError as exc:
        remove_empty_partial()  # a refusal leaves nothing to resume
        raise _status_error(
            exc.status,
            ref,
            hub,
            error_code=exc.error_code,
            detail=exc.detail,
            download=_Download(f.path, sha, exc.url),
        ) from exc
    except blobfetch.TransferError as exc:
        raise TransientPrefetchError(
            f"{where}: {exc}; the {partial.stat().st_size} bytes received are kept in {partial} "
            "and the next try resumes from there"
        ) from exc
    except blobfetch.ProtocolError as exc:
        raise PrefetchError(f"{where}: {exc}: the hub is inconsistent; retry later") from exc
    except OSError as exc:
        raise PrefetchError(
            f"{where}: cannot write {partial} ({exc}): check the NAS mount and its free space"
        ) from exc
    if digest != f.expected_digest:
        observer.on_message(
            f"{where} arrived with {f.verification} {digest}, the hub's list says "
            f"{f.expected_digest}: fetching it again"
        )
        partial.unlink()
        return None
    os.replace(partial, blob)
    _link(pointer, blob)
    return _manifest_entry(pointer, f)


def _link(pointer: Path, blob: Path) -> None:
    """Point the snapshot entry at the blob with a relative symlink, as huggingface_hub does."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    tmp = pointer.with_name(f".{pointer.name}.{os.getpid()}.{threading.get_ident()}.link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(os.path.relpath(blob, pointer.parent))
    os.replace(tmp, pointer)


def _write_manifest(cache_dir: Path, repo: str, sha: str, entries: list[dict[str, Any]]) -> None:
    path = manifest_path(cache_dir, repo, sha)
    payload = {"version": MANIFEST_VERSION, "repo": repo, "sha": sha, "files": entries}
    _atomic_write(path, json.dumps(payload, indent=1, sort_keys=True))


def _write_tree_cache(storage: Path, sha: str, files: Sequence[_HubFile]) -> None:
    """Record the commit's file list where huggingface_hub keeps it: what its own
    snapshot_download would have left."""
    write_commit_files(
        storage,
        sha,
        {f.path: TreeFile(size=f.size, blob_id=f.blob_id, lfs_sha256=f.lfs_sha256) for f in files},
    )


def _write_ref(cache_dir: Path, ref: RepoLike, sha: str) -> None:
    """Point refs/<branch> at `sha`: offline engines resolve an unpinned repo through it."""
    revision = ref.revision or "main"
    if revision == sha:
        return
    path = storage_dir(cache_dir, ref.repo) / "refs" / revision
    with contextlib.suppress(FileNotFoundError):
        if path.read_text() == sha:
            return
    _atomic_write(path, sha)


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def repo_lock(
    storage: Path, repo: str, *, wait_s: float, observer: PrefetchObserver, poll_s: float = 0.5
) -> Iterator[None]:
    """Hold the repo's NAS lock: one prefetch at a time per repo, across hosts and flows.

    flock is released by the kernel when its holder dies, so a crashed flow leaves no stale lock;
    on NFS the Linux client maps flock to NLM/NFSv4 byte-range locks, which the server arbitrates
    across hosts. The holder writes who it is into the file so a waiter can say whom it waits for.
    """
    lock_path = storage / MANIFEST_DIRNAME / LOCK_FILENAME
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
                if time.monotonic() >= deadline:
                    raise PrefetchError(
                        f"{repo}: gave up after {wait_s:.0f} s waiting for the prefetch lock "
                        f"{lock_path}, held by {holder}; wait for that prefetch or stop it"
                    ) from None
                if not announced:
                    observer.on_message(f"{repo}: waiting for {lock_path}, held by {holder}")
                    announced = True
                time.sleep(poll_s)
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class _Meter:
    """Bytes done of the whole prefetch call, reported every interval while a round downloads.

    The download threads only add to a counter; one reporting thread calls the observer, so an
    observer never runs concurrently with itself.
    """

    _RATE_WINDOW_S = 10.0

    def __init__(self, total_bytes: int, observer: PrefetchObserver, interval_s: float) -> None:
        self.total_bytes = total_bytes
        self.done_bytes = 0
        self._observer = observer
        self._interval_s = interval_s
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self._round_bytes = 0
        self._round_lock = threading.Lock()

    def retarget(self, delta: int) -> None:
        self.total_bytes += delta

    def add(self, count: int) -> None:
        """Bytes of the current round now on disk: written, or found in a resumed partial."""
        with self._round_lock:
            self._round_bytes += count

    @contextlib.contextmanager
    def watching(self, repo: str, round_bytes: int) -> Iterator[None]:
        stop = threading.Event()
        base = self.done_bytes
        self._samples.append((time.monotonic(), base))
        with self._round_lock:
            self._round_bytes = 0

        def sample() -> None:
            with self._round_lock:
                written = self._round_bytes
            # A restarted file counts its bytes twice; the round never reports more than its size.
            self._report(repo, base + min(written, round_bytes))

        def run() -> None:
            while not stop.wait(self._interval_s):
                sample()

        thread = threading.Thread(target=run, name="prefetch-meter", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
        self._report(repo, base + round_bytes)

    def _report(self, repo: str, done: int) -> None:
        now = time.monotonic()
        self.done_bytes = max(self.done_bytes, done)
        self._samples.append((now, self.done_bytes))
        while len(self._samples) > 2 and now - self._samples[0][0] > self._RATE_WINDOW_S:
            self._samples.popleft()
        t0, d0 = self._samples[0]
        rate = (self.done_bytes - d0) / (now - t0) if now > t0 else 0.0
        left = max(self.total_bytes - self.done_bytes, 0)
        eta = left / rate if rate > 0 else (0.0 if left == 0 else None)
        self._observer.on_progress(Progress(repo, self.done_bytes, self.total_bytes, rate, eta))


@contextlib.contextmanager
def _hub_errors(ref: RepoLike, hub: HubAccess) -> Iterator[None]:
    try:
        yield
    except PrefetchError:
        raise
    except Exception as exc:
        mapped = _map_hub_error(exc, ref, hub)
        if mapped is None:
            raise
        raise mapped from exc


def _map_hub_error(exc: BaseException, ref: RepoLike, hub: HubAccess) -> PrefetchError | None:
    """The PrefetchError for a failed huggingface_hub call, or None if it is not a hub failure."""
    for cause in _cause_chain(exc):
        if isinstance(cause, HfHubHTTPError) and cause.response is not None:
            headers = cause.response.headers
            return _status_error(
                cause.response.status_code,
                ref,
                hub,
                error_code=headers.get("X-Error-Code"),
                detail=headers.get("X-Error-Message") or "",
                retry_after_s=blobfetch.retry_after_s(headers),
            )
        if isinstance(cause, httpx2.TransportError):
            return TransientPrefetchError(
                f"cannot reach the hub at {hub.endpoint} for {ref.repo}@{ref.revision or 'main'} "
                f"({type(cause).__name__}: {cause}): check the network and HF_ENDPOINT"
            )
    return None


@dataclass(frozen=True)
class _Download:
    """The file download a hub error answered: the file, the commit it is of, the URL asked."""

    path: str
    sha: str
    url: str


def _status_error(
    status: int,
    ref: RepoLike,
    hub: HubAccess,
    *,
    error_code: str | None = None,
    detail: str = "",
    retry_after_s: float | None = None,
    download: _Download | None = None,
) -> PrefetchError:
    """The error for an HTTP status from the hub, named from its X-Error-Code, with the fix.

    `download`: the status answered a file's download (None: the revision's info).
    """
    where = f"{ref.repo}@{ref.revision or 'main'}"
    answer = f"HTTP {status} {error_code}" if error_code else f"HTTP {status}"
    page = f"{hub.endpoint.rstrip('/')}/{ref.repo}"
    if error_code == "GatedRepo":
        if not hub.token:
            return PrefetchError(
                f"{where} is a gated repo on {hub.endpoint} ({answer}) and no token was sent:"
                f" accept the licence at {page} with your Hugging Face account and set HF_TOKEN"
                f" (or the Prefect Secret block '{TOKEN_SECRET_BLOCK}') to a token of that account"
            )
        return PrefetchError(
            f"{where} is a gated repo on {hub.endpoint} ({answer}) and the token from"
            f" {hub.token_source} has no access to it: accept the licence at {page} with the"
            " account that token belongs to (the repo's authors may have to approve it), or set"
            f" HF_TOKEN (or the Prefect Secret block '{TOKEN_SECRET_BLOCK}') to a token of an"
            " account that has access"
        )
    if status == 401 and error_code is None and detail == _INVALID_TOKEN_MESSAGE:
        return PrefetchError(
            f"the hub at {hub.endpoint} refused the token from {hub.token_source} for {where}"
            f" ({answer}: {detail}): the token is revoked, expired or mistyped; set HF_TOKEN (or"
            f" the Prefect Secret block '{TOKEN_SECRET_BLOCK}') to a valid token"
        )
    if error_code == "RepoNotFound" or (status == 401 and download is None):
        private = (
            f"; if it is private, the token from {hub.token_source} cannot read it"
            if hub.token
            else f"; if it is private, set HF_TOKEN (or the Prefect Secret block"
            f" '{TOKEN_SECRET_BLOCK}') to a token of an account that can read it"
        )
        return PrefetchError(
            f"{where} not found on {hub.endpoint} ({answer}): check the repo name in the"
            f" recipe{private}"
        )
    if error_code == "RevisionNotFound" and download is not None:
        return TransientPrefetchError(
            f"{where}: commit {download.sha} is no longer on the hub at {hub.endpoint} ({answer}"
            f" for {download.path}): the branch moved while this prefetch ran (a force-push);"
            " the next try takes its new head"
        )
    if error_code == "RevisionNotFound" or (status == 404 and download is None):
        return PrefetchError(
            f"{ref.repo} has no revision {ref.revision or 'main'!r} on {hub.endpoint}"
            f" ({answer}): fix the revision pinned in the recipe"
        )
    if download is not None and status == 404:
        return PrefetchError(
            f"{where}: {download.path} is in the file list of commit {download.sha} but"
            f" {download.url} answers {answer}: the hub has lost the file; tell the repo's"
            " owner, or pin another revision in the recipe"
        )
    if status in blobfetch.TRANSIENT_STATUS:
        error = TransientPrefetchError(
            f"the hub at {hub.endpoint} answered {answer} for {where}"
            + ("" if retry_after_s is None else f" with Retry-After: {retry_after_s:.0f} s")
            + _retry_hint(retry_after_s, hub)
        )
        error.retry_after_s = retry_after_s
        return error
    return PrefetchError(
        f"the hub at {hub.endpoint} answered {answer} for {where}"
        + (f" ({download.url})" if download is not None else "")
        + (f": {detail}" if detail else "")
    )


def _retry_hint(retry_after_s: float | None, hub: HubAccess) -> str:
    if retry_after_s is not None and retry_after_s > hub.max_retry_after_s:
        return (
            f", longer than the {hub.max_retry_after_s:.0f} s a prefetch waits in place: the"
            " task tries again later"
        )
    return ": a hub-side failure or a rate limit, retry later"


def _cause_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
