"""What the prefetch tests share: a repo put into an HF cache the way huggingface_hub writes it,
a prefetch from the lab hub on loopback, and an observer that keeps what the prefetch says.
Their fixtures are in prefetch_fixtures.py."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from lab.hub.request_log import STORAGE, RequestRecord
from lab.hub.server import HubServer
from sparkdeploy.steps.prefetch import HubAccess, Progress, RepoOutcome, RepoSpec, prefetch
from sparkdeploy.steps.prefetch.cache import storage_dir, write_manifest
from sparkdeploy.steps.prefetch.hub import HubFile
from sparkdeploy.steps.prefetch.verify import check_files

TINY = "lab-org/tiny"
SHA = "0123456789abcdef0123456789abcdef01234567"


class RecordingObserver:
    def __init__(self) -> None:
        self.progress: list[Progress] = []
        self.messages: list[str] = []

    def on_progress(self, progress: Progress) -> None:
        self.progress.append(progress)

    def on_message(self, message: str) -> None:
        self.messages.append(message)


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def put_cached_file(cache: Path, path: str, data: bytes, *, lfs: bool) -> HubFile:
    """Write one file of TINY@SHA into the HF cache layout the way huggingface_hub does (blob +
    symlink); returns the file as the hub would list it."""
    storage = storage_dir(cache, TINY)
    blob_name = hashlib.sha256(data).hexdigest() if lfs else git_blob_oid(data)
    blob = storage / "blobs" / blob_name
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    pointer = storage / "snapshots" / SHA / path
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    return HubFile(
        path=path,
        size=len(data),
        blob_id=git_blob_oid(data),
        lfs_sha256=hashlib.sha256(data).hexdigest() if lfs else None,
    )


def verify_and_record(cache: Path, files: list[HubFile]) -> list[HubFile]:
    """Verify TINY@SHA's files as the prefetch does and, when all are right, write the manifest;
    returns the files that must be fetched."""
    snapshot = storage_dir(cache, TINY) / "snapshots" / SHA
    verified: dict[str, dict[str, Any]] = {}
    to_fetch = check_files(snapshot, files, verified, RecordingObserver(), TINY)
    if not to_fetch:
        write_manifest(cache, TINY, SHA, [verified[f.path] for f in files])
    return to_fetch


def fetch(
    hub: HubServer, nas: Path, repo: str = TINY, revision: str | None = None, **options: Any
) -> RepoOutcome:
    token = options.pop("token", None)
    [outcome] = prefetch(
        [RepoSpec(repo, revision)],
        nas,
        HubAccess(
            hub.url,
            token=token,
            max_workers=4,
            retry_backoff_s=0.01,
            allow_http_token=True,  # the lab hub on loopback
        ),
        **options,
    )
    return outcome


def snapshot_matches_hub(outcome: RepoOutcome, repos_dir: Path) -> bool:
    source = repos_dir / outcome.repo
    return all(
        (Path(outcome.snapshot_dir) / f.path).read_bytes() == (source / f.path).read_bytes()
        for f in outcome.files
    )


def resolve_gets(hub: HubServer) -> list[RequestRecord]:
    """The GETs that answered with a file's bytes: a small file's from the hub, an LFS file's
    from the storage host the hub redirected to."""
    return [
        r
        for r in hub.requests()
        if r.method == "GET"
        and r.status in (200, 206)
        and ("/resolve/" in r.path or r.origin == STORAGE)
    ]
