"""The download: a revision's missing files into blobs/ and the snapshot, over several connections.

The bytes are moved by sparkdeploy.remote.blobfetch (http.client threads, resumable partial
files, hashed while written; the hub's redirects to its storage host followed without the
token). A partial file stays on the NAS when a download fails, and the next try resumes from it.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sparkdeploy.errors import PrefetchError, TransientPrefetchError
from sparkdeploy.remote import blobfetch
from sparkdeploy.steps.prefetch.cache import PARTIAL_SUFFIX, link, manifest_entry
from sparkdeploy.steps.prefetch.hub import HubAccess, HubFile, RepoLike
from sparkdeploy.steps.prefetch.hub_errors import FileDownload, status_error
from sparkdeploy.steps.prefetch.progress import Meter, PrefetchObserver


def fetch_files(
    storage: Path,
    ref: RepoLike,
    sha: str,
    files: Sequence[HubFile],
    hub: HubAccess,
    meter: Meter,
    observer: PrefetchObserver,
    verified: dict[str, dict[str, Any]],
) -> None:
    """Download `files` over hub.max_workers connections into blobs/ and the snapshot.

    What arrives with the right digest is added to `verified`; a file that arrives corrupt, or
    whose blob was already present, is left for verify.check_files to judge.
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
    f: HubFile,
    hub: HubAccess,
    meter: Meter,
    observer: PrefetchObserver,
) -> dict[str, Any] | None:
    """Put `f` into blobs/ and link it from the snapshot; its manifest entry if verified here."""
    blob = storage / "blobs" / f.blob_name
    pointer = storage / "snapshots" / sha / f.path
    with contextlib.suppress(FileNotFoundError):
        if blob.stat().st_size == f.size:
            link(pointer, blob)  # another revision's blob, or a link lost: check_files hashes it
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
        raise status_error(
            exc.status,
            ref,
            hub,
            error_code=exc.error_code,
            detail=exc.detail,
            download=FileDownload(f.path, sha, exc.url),
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
    link(pointer, blob)
    return manifest_entry(pointer, f)
