"""Prefetch of hub repos into the NAS HF cache: fetched and verified once, recognised instantly.

huggingface_hub's `snapshot_download` moves the bytes and writes the standard cache layout
(`models--org--name/{blobs,refs,snapshots}`). Around it this module adds what a shared NAS cache
needs: a free-space check before anything is fetched, a per-repo lock so two flows never download
the same repo at once, a sha256 (LFS) or git-oid (small files) check of every file once, and a
manifest per commit, `models--org--name/.sparkdeploy/<sha>.json`, that records each file's size
and the inode and mtime it had when verified. A repo whose manifest still matches the disk is
complete: that check is one stat per file and never reads file data.
"""

from __future__ import annotations

import collections
import contextlib
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

import httpx2
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import set_client_factory
from huggingface_hub.utils._http import hf_request_event_hook
from huggingface_hub.utils.tqdm import tqdm as hf_tqdm

from sparkdeploy.errors import PrefetchError, TransientPrefetchError

PUBLIC_HUB = "https://huggingface.co"
TOKEN_SECRET_BLOCK = "hf-token"
MANIFEST_DIRNAME = ".sparkdeploy"
MANIFEST_VERSION = 1
LOCK_FILENAME = "prefetch.lock"
DOWNLOAD_CHUNK_BYTES = 1 << 20

_COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
_HASH_CHUNK = 8 << 20
# A `*.incomplete` file untouched this long belongs to a download that died (huggingface_hub names
# them per process, so no later run resumes them); we hold the repo lock, so it is safe to remove.
_ABANDONED_PARTIAL_AGE_S = 600.0
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})

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
    """Where the hub is and how to talk to it. The token stays out of repr, so out of logs."""

    endpoint: str = field(default_factory=lambda: os.environ.get("HF_ENDPOINT") or PUBLIC_HUB)
    token: str | None = field(default=None, repr=False)
    max_workers: int = 8
    # Applied to every hub request huggingface_hub would otherwise send without any timeout
    # (the tree listing, for one); for a download it bounds each read, not the whole file.
    request_timeout_s: float = 60.0


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


@dataclass
class _Pending:
    """A repo that is not known complete: its commit, its files and what is missing."""

    ref: RepoLike
    sha: str
    files: list[_HubFile]
    missing_bytes: int


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


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
    _configure_huggingface_hub(hub.request_timeout_s)
    api = HfApi(endpoint=hub.endpoint, token=_token_argument(hub))

    outcomes: dict[tuple[str, str | None], RepoOutcome] = {}
    pending: list[_Pending] = []
    for ref in _unique(repos):
        sha = _resolve_sha(api, ref, hub)
        complete = _complete_outcome(cache_dir, ref, sha)
        if complete is not None:
            _write_ref(cache_dir, ref, sha)
            outcomes[(ref.repo, ref.revision)] = complete
            observer.on_message(
                f"{ref.repo}@{sha[:12]}: complete in the NAS cache "
                f"({len(complete.files)} files, {human_bytes(complete.total_bytes)})"
            )
            continue
        files = _list_files(api, ref, sha, hub)
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


def _resolve_sha(api: HfApi, ref: RepoLike, hub: HubAccess) -> str:
    if ref.revision is not None and _COMMIT_SHA.fullmatch(ref.revision):
        return ref.revision
    with _hub_errors(ref, hub):
        info = api.model_info(ref.repo, revision=ref.revision, timeout=hub.request_timeout_s)
    if not info.sha:
        raise PrefetchError(
            f"the hub at {hub.endpoint} returned no commit sha for {ref.repo}@{ref.revision}: "
            "is HF_ENDPOINT a Hugging Face hub?"
        )
    return info.sha


def _list_files(api: HfApi, ref: RepoLike, sha: str, hub: HubAccess) -> list[_HubFile]:
    with _hub_errors(ref, hub):
        entries = list(api.list_repo_tree(ref.repo, revision=sha, recursive=True))
    return [
        _HubFile(
            path=e.path,
            size=e.size,
            blob_id=e.blob_id,
            lfs_sha256=e.lfs.sha256 if e.lfs is not None else None,
        )
        for e in entries
        if isinstance(e, RepoFile)
    ]


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
        _remove_abandoned_partials(storage / "blobs")
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
            targets = [(snapshot / f.path, f.size) for f in to_fetch]
            with meter.watching(ref.repo, storage / "blobs", targets):
                _download(cache_dir, ref, sha, hub)
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
    st = pointer.stat()
    if f.lfs_sha256 is not None:
        digest = file_digest(pointer, "sha256")
    else:
        digest = file_digest(pointer, "sha1", prefix=b"blob %d\0" % st.st_size)
    if digest != f.expected_digest:
        return None
    return {
        "path": f.path,
        "size": f.size,
        "verified": f.verification,
        "digest": digest,
        "ino": st.st_ino,
        "mtime_ns": st.st_mtime_ns,
    }


def file_digest(path: Path, algorithm: str, *, prefix: bytes = b"") -> str:
    """Hex digest of `prefix` + the file, streamed, leaving none of the file in page cache.

    The NAS copy is read once here; on unified-memory nodes cached pages are memory the model
    needs, so each chunk is dropped from the cache right after hashing.
    """
    digest = hashlib.new(algorithm)
    digest.update(prefix)
    buffer = bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        fd = fh.fileno()
        offset = 0
        while n := fh.readinto(buffer):
            digest.update(view[:n])
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
            offset += n
    return digest.hexdigest()


def _remove_file(pointer: Path) -> None:
    """Remove a snapshot entry and, when it is a symlink, the blob it points to."""
    if pointer.is_symlink():
        pointer.resolve().unlink(missing_ok=True)
    pointer.unlink(missing_ok=True)


def _remove_abandoned_partials(blobs: Path) -> None:
    if not blobs.is_dir():
        return
    now = time.time()
    for partial in blobs.glob("*.incomplete"):
        with contextlib.suppress(FileNotFoundError):
            if now - partial.stat().st_mtime > _ABANDONED_PARTIAL_AGE_S:
                partial.unlink()


class _NoProgressBar(hf_tqdm):
    """huggingface_hub's bars, always off: progress is reported by _Meter instead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _download(cache_dir: Path, ref: RepoLike, sha: str, hub: HubAccess) -> None:
    # No allow_patterns: files already in the snapshot cost snapshot_download one stat each, and
    # fnmatch patterns would misread file names with brackets.
    with _hub_errors(ref, hub):
        snapshot_download(
            ref.repo,
            revision=sha,
            cache_dir=cache_dir,
            endpoint=hub.endpoint,
            token=_token_argument(hub),
            max_workers=hub.max_workers,
            tqdm_class=_NoProgressBar,
        )


def _write_manifest(cache_dir: Path, repo: str, sha: str, entries: list[dict[str, Any]]) -> None:
    path = manifest_path(cache_dir, repo, sha)
    payload = {"version": MANIFEST_VERSION, "repo": repo, "sha": sha, "files": entries}
    _atomic_write(path, json.dumps(payload, indent=1, sort_keys=True))


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
    """Bytes done of the whole prefetch call, sampled from disk while snapshot_download runs.

    Reading sizes on disk (finished snapshot entries plus `blobs/*.incomplete`) rather than
    hooking huggingface_hub's progress bars keeps the numbers right across its internal retries
    and resumes, and independent of its private progress plumbing.
    """

    _RATE_WINDOW_S = 10.0

    def __init__(self, total_bytes: int, observer: PrefetchObserver, interval_s: float) -> None:
        self.total_bytes = total_bytes
        self.done_bytes = 0
        self._observer = observer
        self._interval_s = interval_s
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def retarget(self, delta: int) -> None:
        self.total_bytes += delta

    @contextlib.contextmanager
    def watching(self, repo: str, blobs: Path, targets: list[tuple[Path, int]]) -> Iterator[None]:
        stop = threading.Event()
        round_bytes = sum(size for _, size in targets)
        base = self.done_bytes
        self._samples.append((time.monotonic(), base))

        def sample() -> None:
            on_disk = sum(size for path, size in targets if path.exists())
            with contextlib.suppress(FileNotFoundError):
                for partial in os.scandir(blobs):
                    if partial.name.endswith(".incomplete"):
                        with contextlib.suppress(FileNotFoundError):
                            on_disk += partial.stat().st_size
            self._report(repo, base + min(on_disk, round_bytes))

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
    where = f"{ref.repo}@{ref.revision or 'main'}"
    token_hint = (
        f"the token in use has no access: accept the repo's terms on the hub with the account the "
        f"Prefect Secret block '{TOKEN_SECRET_BLOCK}' (or HF_TOKEN) belongs to"
        if hub.token
        else f"no token is set: store one in the Prefect Secret block '{TOKEN_SECRET_BLOCK}' "
        "or export HF_TOKEN"
    )
    for cause in _cause_chain(exc):
        if isinstance(cause, HfHubHTTPError) and cause.response is not None:
            status = cause.response.status_code
            if isinstance(cause, GatedRepoError) or status == 403:
                return PrefetchError(
                    f"{where} is gated on {hub.endpoint} (HTTP {status}): {token_hint}"
                )
            if status == 401:
                return PrefetchError(
                    f"the hub at {hub.endpoint} refused {where} (HTTP 401: the repo is private, "
                    f"gated or misspelled): check the name in the recipe; {token_hint}"
                )
            if isinstance(cause, RevisionNotFoundError):
                return PrefetchError(
                    f"{ref.repo} has no revision {ref.revision!r} on {hub.endpoint} (HTTP 404): "
                    "fix the revision pinned in the recipe"
                )
            if isinstance(cause, RemoteEntryNotFoundError):
                return PrefetchError(
                    f"{where}: {cause.response.url} is in the repo's file list but the hub at "
                    f"{hub.endpoint} answers HTTP 404 for it: the hub is inconsistent; retry later"
                )
            if status == 404:
                return PrefetchError(
                    f"{where} not found on {hub.endpoint} (HTTP 404): check the repo name "
                    "and revision in the recipe"
                )
            if status in _TRANSIENT_STATUS:
                return TransientPrefetchError(
                    f"the hub at {hub.endpoint} answered HTTP {status} for {where}: a hub-side "
                    "failure, retry later"
                )
            return PrefetchError(f"the hub at {hub.endpoint} answered HTTP {status} for {where}")
        if isinstance(cause, httpx2.TransportError):
            return TransientPrefetchError(
                f"cannot reach the hub at {hub.endpoint} for {where} "
                f"({type(cause).__name__}: {cause}): check the network and HF_ENDPOINT"
            )
    return None


def _cause_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


class _DefaultTimeoutTransport(httpx2.HTTPTransport):
    """Gives every request without a timeout one: huggingface_hub sends some with none at all."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self._timeout_s = timeout_s

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        limits = dict(request.extensions.get("timeout") or {})
        for phase in ("connect", "read", "write", "pool"):
            if limits.get(phase) is None:
                limits[phase] = self._timeout_s
        request.extensions["timeout"] = limits
        return super().handle_request(request)


_configured_timeout_s: float | None = None
_configure_lock = threading.Lock()


def _configure_huggingface_hub(timeout_s: float) -> None:
    """Process-wide settings of huggingface_hub this module depends on.

    - Its shared HTTP client gets _DefaultTimeoutTransport, so no request goes without a timeout.
    - Its write chunk drops from 10 MiB to DOWNLOAD_CHUNK_BYTES: http_get resumes a cut download
      from the last whole chunk it wrote, so the chunk bounds what a cut costs twice; and its
      10 MiB chunking measured 2-3x slower than 1 MiB on loopback (bench/prefetch.py).
    """
    global _configured_timeout_s
    with _configure_lock:
        hf_constants.DOWNLOAD_CHUNK_SIZE = DOWNLOAD_CHUNK_BYTES
        if _configured_timeout_s == timeout_s:
            return

        def factory() -> httpx2.Client:
            return httpx2.Client(
                event_hooks={"request": [hf_request_event_hook]},
                follow_redirects=True,
                transport=_DefaultTimeoutTransport(timeout_s),
            )

        set_client_factory(factory)
        _configured_timeout_s = timeout_s
