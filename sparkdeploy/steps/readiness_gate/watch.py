"""The state of one boot as its events arrive: each node's markers, the timeline, the failure.

Whoever follows the logs puts these events on the gate's queue: a LogLine per line, a
ContainerExited once a container has stopped (ContainerMissing when there is no such container),
LinkLost while a node's SSH link is down and its follower reconnects (LinkRestored once its log
is followed again) and LinkLost with given_up when the follower stops trying. BootWatch is pure:
no I/O, no clock of its own; what a vLLM line means is sparkdeploy.vllm.log_lines'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sparkdeploy.vllm.log_lines import (
    LINES_AFTER,
    LINES_BEFORE,
    Failure,
    LogLine,
    NodeLog,
    compile_markers,
    exception_text,
    failure_of_line,
    fatal_marker,
    find_root_cause,
    quote_line,
    strip_log_prefix,
)
from sparkdeploy.vllm.markers import (
    DEFAULT_BOOT_MARKERS,
    DEFAULT_FAILURE_MARKERS,
    DEFAULT_RECORDED_MARKERS,
    HEADLESS_WORKER_JOINED,
    WORKER_RECORDED_MARKERS,
    MarkerLike,
)

SIGKILL_EXIT_CODE = 137  # 128 + SIGKILL: the OOM killer's signal, and everyone else's
# The fix for `link_lost`, no engine fault (sparkdeploy.vllm.markers' hints are the engine's).
LINK_LOST_HINT = (
    "check the node's network and its sshd (ping it, ssh to it), then redeploy; nothing says "
    "the engine failed"
)


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
class BootMarkers:
    """The lines a boot is watched for: required on the head (`boot`) and on each worker
    (`worker`: a --headless worker prints its join), recorded when seen, and fatal."""

    boot: Sequence[MarkerLike] = DEFAULT_BOOT_MARKERS
    worker: Sequence[MarkerLike] = (HEADLESS_WORKER_JOINED,)
    failure: Sequence[MarkerLike] = DEFAULT_FAILURE_MARKERS
    recorded: Sequence[MarkerLike] = DEFAULT_RECORDED_MARKERS
    worker_recorded: Sequence[MarkerLike] = WORKER_RECORDED_MARKERS


DEFAULT_MARKERS = BootMarkers()


class BootWatch:
    """The state of one boot as its events arrive. Pure: no I/O, no clock of its own."""

    def __init__(
        self,
        *,
        head: str,
        workers: Sequence[str],
        started_at: float,
        markers: BootMarkers = DEFAULT_MARKERS,
        node_of_ip: Mapping[str, str] | None = None,
    ) -> None:
        self.head = head
        self.started_at = started_at
        self.timeline: list[TimelineEntry] = []
        self.head_figures: dict[str, float] = {}
        self.node_of_ip = dict(node_of_ip or {})
        self._nodes = {head: NodeLog.watching(markers.boot, markers.recorded)}
        for worker in workers:
            self._nodes[worker] = NodeLog.watching(markers.worker, markers.worker_recorded)
        self._failure_markers = compile_markers(markers.failure)
        # The nodes whose log cannot arrive now (their link dropped, reconnecting).
        self.links_down: dict[str, LinkLost] = {}

    @property
    def nodes(self) -> list[str]:
        return list(self._nodes)

    @property
    def complete(self) -> bool:
        return all(node_log.awaited() is None for node_log in self._nodes.values())

    def awaited(self) -> tuple[str, str, str] | None:
        """(node, marker name, pattern) of the first marker still missing, head first."""
        for node, node_log in self._nodes.items():
            missing = node_log.awaited()
            if missing is not None:
                return node, *missing
        return None

    def unjoined_workers(self) -> list[str]:
        """The workers still missing a worker marker (they never joined the process group)."""
        return [
            node
            for node, node_log in self._nodes.items()
            if node != self.head and node_log.awaited() is not None
        ]

    def lines(self, node: str) -> list[str]:
        node_log = self._nodes.get(node)
        return [] if node_log is None else list(node_log.lines)

    def tail(self, node: str, count: int = LINES_AFTER * 2) -> list[str]:
        node_log = self._nodes.get(node)
        return [] if node_log is None else list(node_log.lines)[-count:]

    def record(
        self, marker: str, node: str, t: float, figures: dict[str, float], line: str
    ) -> None:
        self.timeline.append(
            TimelineEntry(marker, node, round(t - self.started_at, 3), figures, quote_line(line))
        )

    def observe(self, event: GateEvent) -> Failure | None:
        node_log = self._nodes.get(event.node)
        if node_log is None:
            return None
        if isinstance(event, ContainerExited):
            return self._exited(event, node_log)
        if isinstance(event, ContainerMissing):
            cause = f"its container does not exist on {event.node} ({event.detail})"
            return Failure(event.node, "container_missing", cause, [quote_line(event.detail)])
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
        earlier = list(node_log.lines)
        node_log.lines.append(event.line)
        fatal = fatal_marker(event.line, self._failure_markers)
        if fatal is not None:
            name, match = fatal
            return failure_of_line(event.node, name, match, event.line, earlier, self.node_of_ip)
        for name, figures in node_log.newly_seen(event.line):
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

    def _exited(self, event: ContainerExited, node_log: NodeLog) -> Failure:
        lines = list(node_log.lines)
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
        excerpt = [quote_line(line) for line in lines[-(LINES_BEFORE + LINES_AFTER) :]]
        return Failure(event.node, kind, cause, excerpt or ["(the container printed nothing)"])
