"""What a prefetch tells its caller while it runs: messages, and the bytes of the whole call
(done, total, rate, ETA) that the Meter reports every interval while files download."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol


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


class Meter:
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
