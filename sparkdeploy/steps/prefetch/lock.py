"""The per-repo NAS lock: two flows, on one host or several, never fetch one repo at once."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from sparkdeploy.errors import PrefetchError
from sparkdeploy.steps.prefetch.cache import MANIFEST_DIRNAME
from sparkdeploy.steps.prefetch.progress import PrefetchObserver

LOCK_FILENAME = "prefetch.lock"


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
