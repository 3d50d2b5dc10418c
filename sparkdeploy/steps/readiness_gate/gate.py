"""The gate: a BootWatch driven from the event queue, then the endpoint probed once the markers
are in; ready, or errors.BootFailed naming the node and the cause.

    gate = ReadinessGate(head="node1", workers=["node2", "node3"])
    result = gate.wait(events, endpoint="http://10.77.0.11:8000", served_model_name="dsv41",
                       timeout_s=600)
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pydantic import SecretStr

from sparkdeploy.errors import BootFailed
from sparkdeploy.remote.engine_http import ProbeOutcome, probe_completion, probe_endpoint
from sparkdeploy.steps.readiness_gate.watch import (
    DEFAULT_MARKERS,
    BootMarkers,
    BootWatch,
    GateEvent,
    TimelineEntry,
)
from sparkdeploy.vllm.log_lines import LINES_AFTER, Failure, LogLine, quote_line

# After a fatal line, wait this long for the lines that follow it (the rest of a traceback)
# before raising; well inside the 2 s the gate has to report a failure.
TRAILING_LINES_GRACE_S = 0.3
# The one test completion gets the gate's time left, but never less than this.
COMPLETION_MIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class GateResult:
    ready_after_s: float
    timeline: list[TimelineEntry]
    figures: dict[str, float]  # the head's parsed figures, e.g. kv_cache_tokens


class ReadinessGate:
    """Drives a BootWatch from an event queue and probes the endpoint once the markers are in."""

    def __init__(
        self,
        *,
        head: str,
        workers: Sequence[str] = (),
        markers: BootMarkers = DEFAULT_MARKERS,
        node_of_ip: Mapping[str, str] | None = None,
        started_at: float | None = None,
        health_poll_s: float = 0.2,
        http_timeout_s: float = 1.0,
        completion_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`node_of_ip` maps fabric addresses to node names (a dead worker is named by it);
        `completion_timeout_s` bounds the one test completion (default: the gate's time left,
        at least COMPLETION_MIN_TIMEOUT_S)."""
        self._clock = clock
        self._health_poll_s = health_poll_s
        self._http_timeout_s = http_timeout_s
        self._completion_timeout_s = completion_timeout_s
        self.watch = BootWatch(
            head=head,
            workers=workers,
            started_at=clock() if started_at is None else started_at,
            markers=markers,
            node_of_ip=node_of_ip,
        )

    @property
    def timeline(self) -> list[TimelineEntry]:
        return self.watch.timeline

    def _elapsed(self) -> float:
        return self._clock() - self.watch.started_at

    def wait(
        self,
        events: queue.Queue[GateEvent],
        *,
        endpoint: str,
        served_model_name: str,
        timeout_s: float,
        api_key: SecretStr | None = None,
    ) -> GateResult:
        watch = self.watch
        deadline = watch.started_at + timeout_s
        next_probe = 0.0
        last_probe: ProbeOutcome | None = None
        while True:
            now = self._clock()
            if watch.complete and now >= next_probe:
                last_probe = probe_endpoint(
                    endpoint, served_model_name, timeout=self._http_timeout_s, api_key=api_key
                )
                if last_probe.ready:
                    return self._complete_one(
                        events, endpoint, served_model_name, deadline, api_key
                    )
                if last_probe.served_names is not None:
                    raise self._wrong_name(served_model_name, last_probe).to_error(self._elapsed())
                next_probe = self._clock() + self._health_poll_s
                continue
            if now >= deadline:
                raise self._timed_out(timeout_s, endpoint, served_model_name, last_probe, api_key)
            wait_s = deadline - now
            if watch.complete:
                wait_s = min(wait_s, next_probe - now)
            try:
                event = events.get(timeout=max(wait_s, 0.0))
            except queue.Empty:
                continue
            failure = watch.observe(event)
            if failure is not None:
                if isinstance(event, LogLine):  # an exited container prints nothing more
                    failure = self._with_trailing_lines(failure, events)
                raise failure.to_error(self._elapsed())

    def _complete_one(
        self,
        events: queue.Queue[GateEvent],
        endpoint: str,
        served_model_name: str,
        deadline: float,
        api_key: SecretStr | None,
    ) -> GateResult:
        """One real completion once /health and /v1/models are good: ready when it answers."""
        self.watch.record(
            "endpoint_healthy",
            self.watch.head,
            self._clock(),
            {},
            f"GET /health 200, /v1/models lists {served_model_name!r}",
        )
        timeout = self._completion_timeout_s
        if timeout is None:
            timeout = max(deadline - self._clock(), COMPLETION_MIN_TIMEOUT_S)
        outcome = probe_completion(endpoint, served_model_name, timeout=timeout, api_key=api_key)
        if outcome.ready:
            return self._ready()
        # The engine may have died under the request: its log says why, better than the reply.
        grace_end = self._clock() + TRAILING_LINES_GRACE_S
        while True:
            remaining = grace_end - self._clock()
            try:
                event = (
                    events.get(timeout=max(remaining, 0.0))
                    if remaining > 0
                    else (events.get_nowait())
                )
            except queue.Empty:
                break
            failure = self.watch.observe(event)
            if failure is not None:
                if isinstance(event, LogLine):
                    failure = self._with_trailing_lines(failure, events)
                raise failure.to_error(self._elapsed())
        raise Failure(
            self.watch.head,
            "completion_failed",
            f"/health and /v1/models are good but a one-token completion failed: {outcome.detail}",
            self.watch.tail(self.watch.head) or ["(no log lines from the head)"],
        ).to_error(self._elapsed())

    def _ready(self) -> GateResult:
        seconds = self._elapsed()
        self.watch.record(
            "endpoint_ready", self.watch.head, self._clock(), {}, "POST /v1/completions 200"
        )
        figures = {**self.watch.head_figures, "ready_s": round(seconds, 3)}
        return GateResult(round(seconds, 3), list(self.watch.timeline), figures)

    def _with_trailing_lines(self, failure: Failure, events: queue.Queue[GateEvent]) -> Failure:
        grace_end = self._clock() + TRAILING_LINES_GRACE_S
        trailing: list[str] = []
        while len(trailing) < LINES_AFTER:
            remaining = grace_end - self._clock()
            if remaining <= 0:
                break
            try:
                event = events.get(timeout=remaining)
            except queue.Empty:
                break
            if isinstance(event, LogLine) and event.node == (failure.log_node or failure.node):
                trailing.append(quote_line(event.line))
        return failure.followed_by(trailing)

    def _wrong_name(self, served_model_name: str, probe: ProbeOutcome) -> Failure:
        return Failure(
            self.watch.head,
            "served_name_mismatch",
            f"the engine is up but serves {probe.served_names}, not {served_model_name!r}",
            self.watch.tail(self.watch.head),
        )

    def _timed_out(
        self,
        timeout_s: float,
        endpoint: str,
        served_model_name: str,
        last_probe: ProbeOutcome | None,
        api_key: SecretStr | None,
    ) -> BootFailed:
        awaited = self.watch.awaited()
        unjoined = self.watch.unjoined_workers()
        lost = next(iter(self.watch.links_down.values()), None)
        if lost is not None:
            # Its markers (or its join) could not arrive: the link is the cause, not the engine.
            outcome = f"it was not back within the timeout of {timeout_s} s: {lost.detail}"
            return self.watch.link_lost(lost, outcome).to_error(self._elapsed())
        if unjoined:
            # The head waits for them at "world_size=N rank=0 ... backend=gloo", saying nothing.
            names = ", ".join(unjoined)
            cause = (
                f"the worker(s) {names} never joined (no rank-assignment line) within {timeout_s} s"
            )
            node = unjoined[0]
            excerpt = self.watch.tail(node) or ["(no log lines from this node)"]
            head_tail = self.watch.tail(self.watch.head, LINES_AFTER)
            if head_tail:
                excerpt = [*excerpt, f"--- {self.watch.head}:", *head_tail]
            return Failure(node, "worker_never_joined", cause, excerpt).to_error(self._elapsed())
        if awaited is None:
            node = self.watch.head
            detail = last_probe.detail if last_probe else "never probed"
            cause = (
                f"every marker seen, but {endpoint} was not ready within {timeout_s} s ({detail})"
            )
        else:
            node, marker, pattern = awaited
            cause = f"no {marker!r} line (/{pattern}/) within {timeout_s} s"
            # A build that words its lines differently still serves: say so, the fix differs.
            probe = probe_endpoint(
                endpoint, served_model_name, timeout=self._http_timeout_s, api_key=api_key
            )
            if probe.ready:
                cause += (
                    f"; yet {endpoint} is ready: the recipe's marker pattern does not match "
                    "this build's log"
                )
        excerpt = self.watch.tail(node) or ["(no log lines from this node)"]
        return Failure(node, "timeout", cause, excerpt).to_error(self._elapsed())
