"""sparkdeploy.steps.prefetch.progress: the byte meter of a prefetch call."""

from __future__ import annotations

from prefetch_hub import RecordingObserver

from sparkdeploy.steps.prefetch.progress import Meter


def test_a_round_never_reports_more_than_its_bytes_and_ends_complete() -> None:
    observer = RecordingObserver()
    meter = Meter(100, observer, interval_s=0.001)
    with meter.watching("org/x", 60):
        meter.add(60)
        meter.add(60)  # a file restarted from byte 0 counts its bytes twice
    meter.retarget(-40)  # the rest was found complete meanwhile
    with meter.watching("org/x", 0):
        pass
    assert observer.progress, "the meter reports at least once per round"
    assert all(p.done_bytes <= 60 for p in observer.progress)
    last = observer.progress[-1]
    assert (last.repo, last.done_bytes, last.total_bytes, last.eta_s) == ("org/x", 60, 60, 0.0)
