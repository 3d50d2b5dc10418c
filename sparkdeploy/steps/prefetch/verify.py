"""Every file checked once against the hub's list: a sha256 for an LFS file, the git oid for a
small one. A file that does not match is removed (its blob too), so it is fetched again."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sparkdeploy.remote import blobfetch
from sparkdeploy.steps.prefetch.cache import manifest_entry, remove_file
from sparkdeploy.steps.prefetch.hub import HubFile
from sparkdeploy.steps.prefetch.progress import PrefetchObserver
from sparkdeploy.units import human_bytes


def check_files(
    snapshot: Path,
    files: Sequence[HubFile],
    verified: dict[str, dict[str, Any]],
    observer: PrefetchObserver,
    repo: str,
) -> list[HubFile]:
    """Verify the present, not yet verified files; remove bad ones. Returns what must be fetched.

    Verified files are added to `verified` with the identity they had when hashed.
    """
    to_hash: list[HubFile] = []
    to_fetch: list[HubFile] = []
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
            remove_file(pointer)
            to_fetch.append(f)
    if to_hash:
        observer.on_message(
            f"{repo}: verifying {len(to_hash)} files, {human_bytes(sum(f.size for f in to_hash))}"
        )
    workers = max(1, min(4, os.cpu_count() or 1))
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prefetch-verify") as pool:
        entries = list(pool.map(lambda f: _verified_entry(snapshot / f.path, f), to_hash))
    if to_hash:
        hashed = sum(f.size for f in to_hash)
        seconds = time.monotonic() - started
        observer.on_message(
            f"{repo}: hashed {len(to_hash)} files, {human_bytes(hashed)} ({hashed} bytes), in"
            f" {seconds:.2f} s ({human_bytes(int(hashed / max(seconds, 1e-6)))}/s)"
        )
    for f, entry in zip(to_hash, entries, strict=True):
        if entry is not None:
            verified[f.path] = entry
            continue
        observer.on_message(
            f"{repo}: {f.path} does not match its {f.verification} {f.expected_digest}: "
            "removed, fetching again"
        )
        remove_file(snapshot / f.path)
        to_fetch.append(f)
    return to_fetch


def _verified_entry(pointer: Path, f: HubFile) -> dict[str, Any] | None:
    """The manifest entry of `pointer` if its content matches the hub's digest, else None."""
    digest = f.new_digest()
    blobfetch.hash_file(digest, pointer)
    return manifest_entry(pointer, f) if digest.hexdigest() == f.expected_digest else None
