"""The sentinel's last probe of each deployment, kept where status reads it: one record per
cluster (sparkdeploy.report.history.SentinelRecord), which tasks/sentinel.py writes to a Prefect
Variable (`sentinel-<cluster>`).

Why a Variable, written this seldom: status must say when each deployment was last probed, and
how, without the sentinel sending the Prefect server a request per probe (a probe every 3 s is
1200 an hour per deployment; the sentinel costs the server nothing per probe, and must go on
so). The record is written at most every RECORD_EVERY_S (30 s, so the last probe status shows is
at most that old while the sentinel runs) whatever the number of deployments: one Variable for
the cluster, 120 requests an hour. It is also written at once on a transition to or from
unhealthy (the moments the events mark, so the record never says healthy for long after an
event said otherwise) and when a deployment is first watched. A suspect probe (failed, but not
yet a verdict) waits for the next periodic write: a probe failing now and then under load must
not cost a request each time. The writes go out on a thread of their own, the latest record
winning: a slow server never holds a probe.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from sparkdeploy.report.history import LastProbe, SentinelRecord
from sparkdeploy.steps.sentinel import Outcome, ProbeResult

RECORD_EVERY_S = 30.0
# A deployment not probed for this long is no longer watched (its watch ended): left out.
FORGET_AFTER_S = 2 * RECORD_EVERY_S
# Prefect keeps a Variable's value under 5000 characters (MAX_VARIABLE_VALUE_LENGTH): a cause
# is cut to this, so a cluster's deployments (one per node at most) fit.
CAUSE_CHARS = 160
# Liveness.state of a deployment declared unhealthy.
UNHEALTHY = "unhealthy"


def _utc_now() -> datetime:
    return datetime.now(UTC)


class ProbeLedger:
    """Each watched deployment's last probe, written (write(record's JSON)) as the module says.
    probed() is called from the watches' threads; write runs on the ledger's own thread and
    must not raise (tasks/sentinel.py logs a failed write: the next one comes within 30 s)."""

    def __init__(
        self,
        write: Callable[[dict[str, Any]], None],
        *,
        every_s: float = RECORD_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = _utc_now,
    ) -> None:
        self._write = write
        self._every_s = every_s
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._probes: dict[str, tuple[float, LastProbe]] = {}
        self._written_at: float | None = None
        self._queued = False
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sentinel-record")

    def probed(self, deployment_id: str, result: ProbeResult, before: str, after: str) -> bool:
        """A probe of the deployment, whose liveness went from `before` to `after`; whether a
        write goes out for it. A deployment gone is left out of the next write."""
        now = self._clock()
        if result.outcome is Outcome.GONE:
            with self._lock:
                self._probes.pop(deployment_id, None)
            return False
        probe = LastProbe(
            at=self._wall(),
            outcome=str(result.outcome),
            state=after,
            node=result.node,
            kind=result.kind,
            cause=result.cause[:CAUSE_CHARS],
        )
        with self._lock:
            first = deployment_id not in self._probes
            self._probes[deployment_id] = (now, probe)
            transition = before != after and UNHEALTHY in (before, after)
            periodic = self._written_at is None or now - self._written_at >= self._every_s
            if not (first or transition or periodic) or self._queued:
                return False
            self._queued, self._written_at = True, now
        self._submit()
        return True

    def record(self) -> SentinelRecord:
        """What a write now says: the deployments probed within FORGET_AFTER_S."""
        now = self._clock()
        with self._lock:
            probes = {
                dep: probe
                for dep, (at, probe) in self._probes.items()
                if now - at <= FORGET_AFTER_S
            }
        return SentinelRecord(written=self._wall(), probes=probes)

    def _submit(self) -> None:
        # In the caller's context: Prefect's settings there (its API) are the write's too.
        self._writer.submit(contextvars.copy_context().run, self._write_latest)

    def _write_latest(self) -> None:
        with self._lock:
            self._queued = False
        self._write(self.record().as_json())

    def close(self) -> None:
        """A last write (the probes up to now), then the writer stopped once it is done."""
        self._submit()
        self._writer.shutdown(wait=True)
