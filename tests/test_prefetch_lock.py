"""sparkdeploy.steps.prefetch.lock: one prefetch of a repo at a time, the waiter told whom it
waits for."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from prefetch_hub import TINY, RecordingObserver, fetch

from lab.hub.server import HubServer
from sparkdeploy.errors import PrefetchError
from sparkdeploy.steps.prefetch import Progress, RepoOutcome
from sparkdeploy.steps.prefetch.cache import storage_dir
from sparkdeploy.steps.prefetch.lock import repo_lock

pytest_plugins = ["prefetch_fixtures"]


def test_lock_waiter_names_the_holder_and_gets_the_lock_after_release(tmp_path: Path) -> None:
    storage = storage_dir(tmp_path, TINY)
    holder_inside = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def hold() -> None:
        with repo_lock(storage, TINY, wait_s=5, observer=RecordingObserver()):
            order.append("first")
            holder_inside.set()
            release.wait(5)

    first = threading.Thread(target=hold)
    first.start()
    holder_inside.wait(5)
    waiter = RecordingObserver()
    threading.Timer(0.3, release.set).start()
    with repo_lock(storage, TINY, wait_s=5, observer=waiter, poll_s=0.05):
        order.append("second")
    first.join()
    assert order == ["first", "second"]
    assert len(waiter.messages) == 1
    assert f'"pid": {os.getpid()}' in waiter.messages[0]


def test_lock_wait_gives_up_with_a_clear_error(tmp_path: Path) -> None:
    storage = storage_dir(tmp_path, TINY)
    holder_inside = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with repo_lock(storage, TINY, wait_s=5, observer=RecordingObserver()):
            holder_inside.set()
            release.wait(5)

    first = threading.Thread(target=hold)
    first.start()
    holder_inside.wait(5)
    try:
        with (
            pytest.raises(PrefetchError, match="gave up after 0 s waiting for the prefetch lock"),
            repo_lock(storage, TINY, wait_s=0.2, observer=RecordingObserver(), poll_s=0.05),
        ):
            pass
    finally:
        release.set()
        first.join()


def test_two_concurrent_prefetches_download_once(hub: HubServer, nas: Path) -> None:
    hub.slow(2 << 20)  # per response: about 1.5 s for the largest shard
    first_observer, second_observer = RecordingObserver(), RecordingObserver()
    downloading = threading.Event()

    class Signalling(RecordingObserver):
        def on_progress(self, progress: Progress) -> None:
            first_observer.on_progress(progress)
            if progress.done_bytes > 0:
                downloading.set()

        def on_message(self, message: str) -> None:
            first_observer.on_message(message)

    results: dict[str, RepoOutcome] = {}
    first = threading.Thread(
        target=lambda: results.update(
            first=fetch(hub, nas, observer=Signalling(), progress_interval_s=0.02)
        )
    )
    first.start()
    assert downloading.wait(10)
    results["second"] = fetch(hub, nas, observer=second_observer, lock_wait_s=30)
    first.join()
    assert results["first"].fetched_bytes == results["first"].total_bytes
    assert results["second"].fetched_bytes == 0
    assert hub.bytes_served == results["first"].total_bytes
    assert any("waiting for" in m for m in second_observer.messages)
    assert any("completed by another prefetch" in m for m in second_observer.messages)
