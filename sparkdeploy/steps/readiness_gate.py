"""The readiness gate: follow every container's log at once, decide ready or why not.

Whoever follows the logs (`docker logs -f` over SSH, a local process in tests) puts LogLine
events, and a ContainerExited event once a container has stopped (ContainerMissing when there
is no such container), on one queue.Queue; `follow_lines` does that for any iterable of lines.
A follower whose SSH link dropped puts LinkLost while it reconnects (LinkRestored once its log
is followed again) and LinkLost with given_up when it stops trying: the boot then fails naming
the lost link, as does the timeout while a link is down, rather than blaming the engine for
the lines that could not arrive. The gate consumes the queue:

    gate = ReadinessGate(head="node1", workers=["node2", "node3"])
    result = gate.wait(events, endpoint="http://10.77.0.11:8000", served_model_name="dsv41",
                       timeout_s=600)

Ready = every required boot marker seen on the head, every worker marker (the rank-assignment
line) seen on each worker, then GET /health 200 and GET /v1/models listing the served name
(polled every 0.2 s once the markers are in; connection refused while the engine loads is
normal), then one real completion (POST /v1/completions, max_tokens 1, temperature 0, asked
once with the gate's time left) answering a choice. Recorded markers (sparkdeploy.vllm.markers:
DEFAULT_RECORDED_MARKERS, WORKER_RECORDED_MARKERS) go in the timeline and the figures when seen
but are never waited for. Any failure marker, any container exit (status 0 included: vLLM exits
0 after its engine died), the timeout, a wrong served name or a failed completion raises
errors.BootFailed at once, naming the node and the cause and quoting the log lines around it. A
worker that never joined is named at the timeout. `gate.timeline` (markers, node, seconds since
the start, parsed figures) is there after a failure too.

`classify_log(lines, node=..., node_of_ip=...)` is the same classification of one log's lines,
for whoever watches a deployment after it was ready.
"""

from __future__ import annotations

import dataclasses
import http.client
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pydantic import SecretStr

from sparkdeploy.errors import BootFailed
from sparkdeploy.remote import engine_http
from sparkdeploy.vllm.markers import (
    DEFAULT_BOOT_MARKERS,
    DEFAULT_FAILURE_MARKERS,
    DEFAULT_RECORDED_MARKERS,
    FAILURE_HINTS,
    HEADLESS_WORKER_JOINED,
    ROOT_CAUSE_ABOVE,
    SHUTDOWN_TRIGGERED,
    WORKER_RECORDED_MARKERS,
    MarkerLike,
)

SIGKILL_EXIT_CODE = 137  # 128 + SIGKILL: the OOM killer's signal, and everyone else's
LINES_KEPT_PER_NODE = 400
LINES_BEFORE = 8
LINES_AFTER = 6
# After a fatal line, wait this long for the lines that follow it (the rest of a traceback)
# before raising; well inside the 2 s the gate has to report a failure.
TRAILING_LINES_GRACE_S = 0.3
# The one test completion gets the gate's time left, but never less than this.
COMPLETION_MIN_TIMEOUT_S = 30.0
_MAX_QUOTED_LINE = 400
# The fix for `link_lost`, no engine fault (sparkdeploy.vllm.markers' hints are the engine's).
LINK_LOST_HINT = (
    "check the node's network and its sshd (ping it, ssh to it), then redeploy; nothing says "
    "the engine failed"
)

# "(EngineCore_DP0 pid=12) ERROR 09-18 12:00:00 [core.py:708] " and uvicorn's "INFO:     ".
_VLLM_PREFIX = re.compile(
    r"^(?:\([\w.-]+ pid=\d+\)\s+)?"
    r"(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s+"
    r"|(?:INFO|WARNING|ERROR):\s+)?"
)
_EXCEPTION_LINE = re.compile(
    r"(?:^|[\s\]>|])(?P<text>(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt): .*)$"
)


@dataclass(frozen=True)
class LogLine:
    node: str
    line: str
    t: float  # time.monotonic() when the line was read


@dataclass(frozen=True)
class ExitStatus:
    code: int
    # docker's State.OOMKilled: the kernel killed a process of the container for memory. None
    # when not known (no docker, or inspect failed).
    oom_killed: bool | None


@dataclass(frozen=True)
class ContainerExited:
    node: str
    exit_code: int
    t: float
    oom_killed: bool | None = None  # ExitStatus.oom_killed


@dataclass(frozen=True)
class ContainerMissing:
    node: str
    detail: str  # what docker said of it
    t: float


@dataclass(frozen=True)
class LinkLost:
    """The SSH link under a node's log stream dropped at `since` (time.monotonic()); its lines
    cannot arrive until LinkRestored. `detail`: why it is not back (the last reconnect's error).
    `given_up`: the follower stopped trying, so the boot cannot be watched there."""

    node: str
    detail: str
    since: float
    t: float
    given_up: bool = False


@dataclass(frozen=True)
class LinkRestored:
    node: str
    t: float


GateEvent = LogLine | ContainerExited | ContainerMissing | LinkLost | LinkRestored


@dataclass(frozen=True)
class TimelineEntry:
    marker: str
    node: str
    seconds: float  # since the gate's start
    figures: dict[str, float]
    line: str


@dataclass(frozen=True)
class GateResult:
    ready_after_s: float
    timeline: list[TimelineEntry]
    figures: dict[str, float]  # the head's parsed figures, e.g. kv_cache_tokens


@dataclass(frozen=True)
class Failure:
    node: str  # the node that failed
    kind: str
    cause: str
    excerpt: list[str]
    log_node: str | None = None  # whose log the excerpt is, when not the failed node's
    hint: str | None = None  # when FAILURE_HINTS has none for this kind

    def followed_by(self, lines: Sequence[str]) -> Failure:
        """The same failure with the log lines that came after the fatal one quoted too."""
        return dataclasses.replace(self, excerpt=[*self.excerpt, *lines]) if lines else self

    def to_error(self, seconds: float) -> BootFailed:
        quoted = "\n".join(f"  | {line}" for line in self.excerpt)
        hint = self.hint or FAILURE_HINTS.get(self.kind, FAILURE_HINTS["container_exited"])
        message = (
            f"boot failed on {self.node} after {seconds:.1f} s ({self.kind}): {self.cause}\n"
            f"log of {self.log_node or self.node}:\n{quoted}\nfix: {hint}"
        )
        return BootFailed(
            message, node=self.node, kind=self.kind, cause=self.cause, excerpt=self.excerpt
        )


@dataclass(frozen=True)
class ProbeOutcome:
    ready: bool
    detail: str
    served_names: list[str] | None = None  # what /v1/models listed, once it answered


def strip_log_prefix(line: str) -> str:
    return _VLLM_PREFIX.sub("", line, count=1).strip()


def _quote(line: str) -> str:
    return line if len(line) <= _MAX_QUOTED_LINE else line[:_MAX_QUOTED_LINE] + " ..."


def parse_figures(match: re.Match[str]) -> dict[str, float]:
    return {
        name: float(value.replace(",", ""))
        for name, value in match.groupdict().items()
        if value is not None
    }


def find_root_cause(lines: Sequence[str]) -> int | None:
    """Index of the last exception line ("FooError: ...") in `lines`, or None."""
    for index in range(len(lines) - 1, -1, -1):
        if _EXCEPTION_LINE.search(lines[index]):
            return index
    return None


def exception_text(line: str) -> str:
    match = _EXCEPTION_LINE.search(line)
    return match.group("text").strip() if match else strip_log_prefix(line)


@dataclass
class _NodeProgress:
    markers: list[tuple[str, re.Pattern[str]]]  # required: awaited in this order
    recorded: list[tuple[str, re.Pattern[str]]] = field(default_factory=list)  # never awaited
    seen: set[str] = field(default_factory=set)
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=LINES_KEPT_PER_NODE))

    def awaited(self) -> tuple[str, str] | None:
        for name, pattern in self.markers:
            if name not in self.seen:
                return name, pattern.pattern
        return None


def _compile(markers: Sequence[MarkerLike]) -> list[tuple[str, re.Pattern[str]]]:
    return [(marker.name, re.compile(marker.pattern)) for marker in markers]


def _progress(required: Sequence[MarkerLike], recorded: Sequence[MarkerLike]) -> _NodeProgress:
    """A node's markers; a recorded marker named like a required one is dropped."""
    names = {marker.name for marker in required}
    extra = [marker for marker in recorded if marker.name not in names]
    return _NodeProgress(_compile(required), _compile(extra))


_SHUTDOWN = re.compile(SHUTDOWN_TRIGGERED)


def _peer_node(ip: str, node_of_ip: Mapping[str, str]) -> str:
    node = node_of_ip.get(ip)
    return f"{node} ({ip})" if node else f"at {ip} (no node of this deployment has that address)"


def failure_of_line(
    node: str,
    name: str,
    match: re.Match[str],
    line: str,
    earlier: Sequence[str],
    node_of_ip: Mapping[str, str] | None = None,
) -> Failure:
    """The Failure a fatal `line` of `node`'s log means (`earlier`: the lines before it)."""
    before = [_quote(text) for text in earlier[-LINES_BEFORE:]]
    cause = f"{name}: {strip_log_prefix(line)}"
    if name in ROOT_CAUSE_ABOVE:
        root = find_root_cause(earlier)
        if root is not None:
            cause = (
                f"{name}: the engine core died of {exception_text(earlier[root])} "
                f"(quoted above the final error)"
            )
            before = [_quote(text) for text in earlier[max(root - LINES_BEFORE, 0) : root + 1]]
            if root + 1 < len(earlier):
                before.append("...")
    peer = match.groupdict().get("peer_ip")
    if name == "worker_died" and peer is not None:
        cause = (
            f"worker_died: the worker {_peer_node(peer, node_of_ip or {})} closed its "
            f"connection to {node} (its engine process died); {node}'s engine then dies and "
            f"exits with status 0: {exception_text(line)}"
        )
        dead = (node_of_ip or {}).get(peer)
        if dead is not None:
            return Failure(dead, name, cause, [*before, _quote(line)], log_node=node)
    return Failure(node, name, cause, [*before, _quote(line)])


def classify_log(
    lines: Sequence[str],
    *,
    node: str,
    node_of_ip: Mapping[str, str] | None = None,
    failure_markers: Sequence[MarkerLike] = DEFAULT_FAILURE_MARKERS,
) -> Failure | None:
    """The named failure in one container's log lines (the first fatal line), or None.

    For the gate and for whoever watches a running deployment (the smoke watchdog): `node` is
    the node whose log this is; `node_of_ip` maps fabric addresses to node names, so that the
    head's "Connection closed by peer [ip]" names the worker that died. Lines after vLLM's
    "[shutdown] API server: shutdown triggered" (a deliberate stop) are not read.
    """
    compiled = _compile(failure_markers)
    for index, line in enumerate(lines):
        if _SHUTDOWN.search(line):
            return None
        for name, pattern in compiled:
            match = pattern.search(line)
            if match is not None:
                failure = failure_of_line(
                    node,
                    name,
                    match,
                    line,
                    lines[max(index - LINES_KEPT_PER_NODE, 0) : index],
                    node_of_ip,
                )
                trailing = [_quote(text) for text in lines[index + 1 : index + 1 + LINES_AFTER]]
                return failure.followed_by(trailing)
    return None


class BootWatch:
    """The state of one boot as its events arrive. Pure: no I/O, no clock of its own."""

    def __init__(
        self,
        *,
        head: str,
        workers: Sequence[str],
        started_at: float,
        boot_markers: Sequence[MarkerLike] = DEFAULT_BOOT_MARKERS,
        worker_markers: Sequence[MarkerLike] = (HEADLESS_WORKER_JOINED,),
        failure_markers: Sequence[MarkerLike] = DEFAULT_FAILURE_MARKERS,
        recorded_markers: Sequence[MarkerLike] = DEFAULT_RECORDED_MARKERS,
        worker_recorded_markers: Sequence[MarkerLike] = WORKER_RECORDED_MARKERS,
        node_of_ip: Mapping[str, str] | None = None,
    ) -> None:
        self.head = head
        self.started_at = started_at
        self.timeline: list[TimelineEntry] = []
        self.head_figures: dict[str, float] = {}
        self.node_of_ip = dict(node_of_ip or {})
        self._nodes = {head: _progress(boot_markers, recorded_markers)}
        for worker in workers:
            self._nodes[worker] = _progress(worker_markers, worker_recorded_markers)
        self._failure_markers = _compile(failure_markers)
        # The nodes whose log cannot arrive now (their link dropped, reconnecting).
        self.links_down: dict[str, LinkLost] = {}

    @property
    def nodes(self) -> list[str]:
        return list(self._nodes)

    @property
    def complete(self) -> bool:
        return all(progress.awaited() is None for progress in self._nodes.values())

    def awaited(self) -> tuple[str, str, str] | None:
        """(node, marker name, pattern) of the first marker still missing, head first."""
        for node, progress in self._nodes.items():
            missing = progress.awaited()
            if missing is not None:
                return node, *missing
        return None

    def unjoined_workers(self) -> list[str]:
        """The workers still missing a worker marker (they never joined the process group)."""
        return [
            node
            for node, progress in self._nodes.items()
            if node != self.head and progress.awaited() is not None
        ]

    def lines(self, node: str) -> list[str]:
        progress = self._nodes.get(node)
        return [] if progress is None else list(progress.lines)

    def tail(self, node: str, count: int = LINES_AFTER * 2) -> list[str]:
        progress = self._nodes.get(node)
        return [] if progress is None else list(progress.lines)[-count:]

    def record(
        self, marker: str, node: str, t: float, figures: dict[str, float], line: str
    ) -> None:
        self.timeline.append(
            TimelineEntry(marker, node, round(t - self.started_at, 3), figures, _quote(line))
        )

    def observe(self, event: GateEvent) -> Failure | None:
        progress = self._nodes.get(event.node)
        if progress is None:
            return None
        if isinstance(event, ContainerExited):
            return self._exited(event, progress)
        if isinstance(event, ContainerMissing):
            cause = f"its container does not exist on {event.node} ({event.detail})"
            return Failure(event.node, "container_missing", cause, [_quote(event.detail)])
        if isinstance(event, LinkRestored):
            self.links_down.pop(event.node, None)
            return None
        if isinstance(event, LinkLost):
            self.links_down[event.node] = event
            if not event.given_up:
                return None
            return self.link_lost(
                event, f"could not reconnect for {event.t - event.since:.0f} s: {event.detail}"
            )
        earlier = list(progress.lines)
        progress.lines.append(event.line)
        for name, pattern in self._failure_markers:
            match = pattern.search(event.line)
            if match is not None:
                return failure_of_line(
                    event.node, name, match, event.line, earlier, self.node_of_ip
                )
        for name, pattern in [*progress.markers, *progress.recorded]:
            if name in progress.seen:
                continue
            match = pattern.search(event.line)
            if match is None:
                continue
            progress.seen.add(name)
            figures = parse_figures(match)
            if event.node == self.head:
                self.head_figures.update(figures)
            self.record(name, event.node, event.t, figures, strip_log_prefix(event.line))
        return None

    def link_lost(self, event: LinkLost, outcome: str) -> Failure:
        """The boot failed because `event.node`'s log stopped arriving; `outcome`: what came
        of reconnecting."""
        cause = (
            f"lost the SSH link to {event.node} {event.since - self.started_at:.1f} s into the "
            f"boot (its log stream broke off) and {outcome}; its engine was not seen to fail"
        )
        excerpt = self.tail(event.node) or ["(no log lines from this node)"]
        return Failure(event.node, "link_lost", cause, excerpt, hint=LINK_LOST_HINT)

    def _exited(self, event: ContainerExited, progress: _NodeProgress) -> Failure:
        lines = list(progress.lines)
        # Exit 137 is any SIGKILL: an OOM kill is named so only when the kernel says so.
        if event.oom_killed:
            kind, cause = (
                "oom_killed",
                f"OOM-killed: the kernel killed it for memory (State.OOMKilled is true; exit"
                f" code {event.exit_code})",
            )
        elif event.exit_code == SIGKILL_EXIT_CODE and event.oom_killed is False:
            kind, cause = (
                "killed",
                "killed by SIGKILL (docker kill, docker stop's escalation, or a person), not an"
                " OOM: State.OOMKilled is false",
            )
        elif event.exit_code == SIGKILL_EXIT_CODE:
            kind, cause = (
                "killed",
                "killed by SIGKILL (exit code 137); whether by the kernel's OOM killer is"
                " unknown: docker's State.OOMKilled could not be read",
            )
        elif event.exit_code == 0:
            # vLLM exits 0 after its engine died (e.g. a worker crashed): never a clean stop here.
            kind, cause = (
                "container_exited",
                "the container exited with code 0 before any teardown (vLLM exits 0 after its "
                "engine died)",
            )
        else:
            kind, cause = "container_exited", f"the container exited with code {event.exit_code}"
        root = find_root_cause(lines)
        if root is not None:
            cause += f"; last error in its log: {exception_text(lines[root])}"
        excerpt = [_quote(line) for line in lines[-(LINES_BEFORE + LINES_AFTER) :]]
        return Failure(event.node, kind, cause, excerpt or ["(the container printed nothing)"])


def probe_endpoint(
    endpoint: str, served_model_name: str, *, timeout: float, api_key: SecretStr | None = None
) -> ProbeOutcome:
    """GET /health, then GET /v1/models (with the API key: vLLM guards /v1, never /health);
    ready when the served name is listed."""
    base = endpoint.rstrip("/")
    try:
        health = engine_http.request("GET", f"{base}/health", timeout=timeout)
        if health.status != 200:
            return ProbeOutcome(False, f"/health answered {health.status}")
        models = engine_http.request("GET", f"{base}/v1/models", timeout=timeout, api_key=api_key)
    except ConnectionRefusedError:
        return ProbeOutcome(False, "connection refused (the engine is still loading)")
    except (OSError, http.client.HTTPException) as error:
        return ProbeOutcome(False, f"{type(error).__name__}: {error}")
    if models.status == 401:
        # Not ready will never turn ready: say which key is missing or wrong.
        return ProbeOutcome(
            False,
            "/v1/models answered 401: the engine wants an API key "
            + ("other than the recipe's" if api_key else "and the recipe sets none")
            + " (--api-key in args or env.VLLM_API_KEY)",
        )
    if models.status != 200:
        return ProbeOutcome(False, f"/v1/models answered {models.status}")
    try:
        names = [str(entry["id"]) for entry in models.json()["data"]]
    except (ValueError, KeyError, TypeError) as error:
        return ProbeOutcome(False, f"/v1/models is not an OpenAI model list ({error})")
    return ProbeOutcome(served_model_name in names, f"/v1/models lists {names}", names)


COMPLETION_PROMPT = "Hello"


def probe_completion(
    endpoint: str, served_model_name: str, *, timeout: float, api_key: SecretStr | None = None
) -> ProbeOutcome:
    """POST /v1/completions for one token at temperature 0; ready when it answers a choice.

    The first request to a TP > 1 CPU engine builds a kernel (about 20 s): `timeout` should be
    generous, and this is asked once, not polled.
    """
    body = {
        "model": served_model_name,
        "prompt": COMPLETION_PROMPT,
        "max_tokens": 1,
        "temperature": 0,
    }
    url = f"{endpoint.rstrip('/')}/v1/completions"
    try:
        reply = engine_http.request("POST", url, timeout=timeout, json_body=body, api_key=api_key)
    except (OSError, http.client.HTTPException) as error:
        return ProbeOutcome(False, f"POST /v1/completions: {type(error).__name__}: {error}")
    if reply.status != 200:
        text = reply.body[:300].decode(errors="replace")
        return ProbeOutcome(False, f"POST /v1/completions answered {reply.status}: {text}")
    try:
        choices = reply.json()["choices"]
    except (ValueError, KeyError, TypeError) as error:
        return ProbeOutcome(False, f"POST /v1/completions: not a completion ({error})")
    if not choices:
        return ProbeOutcome(False, "POST /v1/completions answered no choice")
    return ProbeOutcome(True, "POST /v1/completions answered a choice")


class ReadinessGate:
    """Drives a BootWatch from an event queue and probes the endpoint once the markers are in."""

    def __init__(
        self,
        *,
        head: str,
        workers: Sequence[str] = (),
        boot_markers: Sequence[MarkerLike] = DEFAULT_BOOT_MARKERS,
        worker_markers: Sequence[MarkerLike] = (HEADLESS_WORKER_JOINED,),
        failure_markers: Sequence[MarkerLike] = DEFAULT_FAILURE_MARKERS,
        recorded_markers: Sequence[MarkerLike] = DEFAULT_RECORDED_MARKERS,
        worker_recorded_markers: Sequence[MarkerLike] = WORKER_RECORDED_MARKERS,
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
            boot_markers=boot_markers,
            worker_markers=worker_markers,
            failure_markers=failure_markers,
            recorded_markers=recorded_markers,
            worker_recorded_markers=worker_recorded_markers,
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
                trailing.append(_quote(event.line))
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


def follow_lines(
    events: queue.Queue[GateEvent],
    node: str,
    lines: Iterable[bytes | str],
    exit_status: Callable[[], ExitStatus | None],
    *,
    clock: Callable[[], float] = time.monotonic,
) -> threading.Thread:
    """Feed `lines` (e.g. a `docker logs -f` stdout) to the queue from a daemon thread.

    When the lines end, `exit_status()` is asked how the container ended (e.g. from `docker
    wait` and `docker inspect`); an ExitStatus becomes a ContainerExited event, None means
    "still running" (the log stream was cut) and puts nothing.
    """

    def pump() -> None:
        try:
            for raw in lines:
                text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
                events.put(LogLine(node, text.rstrip("\r\n"), clock()))
        except (OSError, ValueError):
            pass  # the stream was closed under us; the exit code below tells what happened
        status = exit_status()
        if status is not None:
            events.put(ContainerExited(node, status.code, clock(), status.oom_killed))

    thread = threading.Thread(target=pump, name=f"follow-logs-{node}", daemon=True)
    thread.start()
    return thread
