"""Readiness of a booted deployment: every container's log, followed over SSH, fed to the gate.

    gate = gate_for(plan)
    result = wait_until_ready(plan, gate)      # GateResult, or errors.BootFailed

For each node, `docker logs --follow --timestamps <container>` streams over that node's SSH
connection (stdout and stderr merged) into the gate's queue, docker's timestamp taken off each
line first. When the SSH link under a stream drops (the stream ends "lost"), the follower
reconnects with backoff and resumes with `--since` the last line's timestamp, skipping the lines
of that instant it fed already, so no line is lost or fed twice; a node unreachable for
RECONNECT_WINDOW_S fails the boot naming the lost link. When a log ends because its container
stopped, `docker wait <container>` supplies the exit code (or says there is no such container)
and `docker inspect` docker's State.OOMKilled, so an exit 137 is named an OOM kill only when the
kernel says so. The gate decides (gate.py); the streams are stopped and their channels closed
however it ends, and `gate.timeline` stays readable after a failure. Boot (starting the
containers) is not done here. `follow_lines` feeds any iterable of lines (a local process in
tests and benchmarks) to the queue the same way.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from sparkdeploy.errors import RemoteError
from sparkdeploy.remote.ssh import Connection, LineStream, SshTarget, cached_connection
from sparkdeploy.remote.targets import node_target
from sparkdeploy.spec.plan import NodePlan, Plan
from sparkdeploy.steps.readiness_gate.gate import GateResult, ReadinessGate
from sparkdeploy.steps.readiness_gate.watch import (
    BootMarkers,
    ContainerExited,
    ContainerMissing,
    ExitStatus,
    GateEvent,
    LinkLost,
    LinkRestored,
)
from sparkdeploy.vllm.log_lines import LogLine

# The log streams outlive the gate's own timeout by this much, so the gate always decides first.
STREAM_MARGIN_S = 30.0
DOCKER_COMMAND_TIMEOUT_S = 15.0
FOLLOWER_JOIN_S = 2.0
NO_SUCH_CONTAINER = "No such container"
# A node unreachable this long is no blip (a switch reboot, a pulled cable): the boot fails
# naming the link rather than waiting out the readiness timeout (600 s by default) for lines
# that cannot arrive.
RECONNECT_WINDOW_S = 60.0
# Reconnects after a lost stream wait 1, 2, 4, 8, 8... s (a connect to a node that does not
# answer takes up to its connect timeout on top).
RECONNECT_FIRST_DELAY_S = 1.0
RECONNECT_MAX_DELAY_S = 8.0
# docker's --timestamps prefix: RFC 3339 with nanoseconds, then one space.
_DOCKER_STAMP = re.compile(
    r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)) (.*)", re.S
)

ConnectionFactory = Callable[[SshTarget], Connection]


def gate_for(plan: Plan, *, started_at: float | None = None) -> ReadinessGate:
    """The gate for this plan's nodes and markers; `started_at` (time.monotonic()) defaults to
    now, and the timeline counts from it."""
    return ReadinessGate(
        head=plan.head.node,
        workers=[node.node for node in plan.workers],
        markers=BootMarkers(boot=plan.boot_markers, failure=plan.failure_markers),
        # the head's gloo "Connection closed by peer [ip]" names a dead worker by this
        node_of_ip={node.fabric_ip: node.node for node in plan.workers},
        started_at=started_at,
    )


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


class _Follower:
    """One node's `docker logs --follow`, feeding the gate's queue from a thread; it reconnects
    and resumes when the SSH link under it drops."""

    def __init__(
        self,
        node: NodePlan,
        connection_for: ConnectionFactory,
        stop: threading.Event,
        events: queue.Queue[GateEvent],
        timeout_s: float,
    ) -> None:
        self.node = node
        self.target = node_target(node)
        self.connection_for = connection_for
        self.connection = connection_for(self.target)
        self.stop = stop
        self.events = events
        self.ends_at = time.monotonic() + timeout_s + STREAM_MARGIN_S
        self.stream: LineStream | None = None
        self.thread: threading.Thread | None = None
        # docker's timestamp of the last line fed, and how many lines fed carried it: `--since`
        # gives that instant's lines again.
        self.last_stamp: str | None = None
        self.fed_at_stamp = 0

    @property
    def container(self) -> str:
        return self.node.container.name

    def start(self) -> None:
        self.stream = self._open()
        lines = self._lines(self.stream)
        self.thread = follow_lines(self.events, self.node.node, lines, self.exit_status)

    def _open(self) -> LineStream:
        lifetime_s = max(self.ends_at - time.monotonic(), 1.0)
        since = [] if self.last_stamp is None else ["--since", self.last_stamp]
        # `timeout` bounds the follower on the node too: closing the SSH channel alone leaves
        # `docker logs` running until its container prints again.
        argv = ["timeout", f"{lifetime_s:.0f}", "docker", "logs", "--follow", "--timestamps"]
        return self.connection.stream_lines(
            [*argv, *since, self.container], timeout=lifetime_s, stop=self.stop
        )

    def _lines(self, stream: LineStream | None) -> Iterator[str]:
        """The log's lines without docker's timestamps, across reconnects, each once."""
        while stream is not None:
            yield from self._unseen(stream)
            stream = self._reconnect() if stream.ended == "lost" else None

    def _unseen(self, stream: LineStream) -> Iterator[str]:
        replayed = self.fed_at_stamp if self.last_stamp is not None else 0
        for raw in stream:
            text = raw.decode("utf-8", "replace")
            match = _DOCKER_STAMP.fullmatch(text)
            if match is None:  # docker's own complaint (no such container), not a log line
                yield text
                continue
            stamp, line = match.groups()
            if stamp != self.last_stamp:
                self.last_stamp, self.fed_at_stamp, replayed = stamp, 0, 0
            elif replayed:
                replayed -= 1
                continue
            self.fed_at_stamp += 1
            yield line

    def _reconnect(self) -> LineStream | None:
        """A new connection and the log resumed on it; None when stopped or given up (the gate
        is told while the link is down, and when this gives up)."""
        lost_at = time.monotonic()
        detail = "its log stream ended without the command's exit (the SSH connection died)"
        self.events.put(LinkLost(self.node.node, detail, lost_at, lost_at))
        # A connection whose transport has not noticed it is dead yet would be handed back by
        # the cache: closed, cached_connection connects anew.
        self.connection.close()
        delay = RECONNECT_FIRST_DELAY_S
        while not self.stop.is_set():
            try:
                self.connection = self.connection_for(self.target)
                self.stream = self._open()
            except RemoteError as error:
                detail = str(error)
            else:
                self.events.put(LinkRestored(self.node.node, time.monotonic()))
                return self.stream
            now = time.monotonic()
            given_up = now + delay - lost_at > RECONNECT_WINDOW_S
            self.events.put(LinkLost(self.node.node, detail, lost_at, now, given_up))
            if given_up:
                return None
            self.stop.wait(delay)
            delay = min(delay * 2, RECONNECT_MAX_DELAY_S)
        return None

    def exit_status(self) -> ExitStatus | None:
        """How the container ended once its log has ended with it; None while it runs.

        A container that does not exist ends its log at once: that is put on the queue as
        ContainerMissing (rather than asking docker about every container before following it,
        which cost each node a docker CLI start on every boot).
        """
        if self.stop.is_set() or self.stream is None or self.stream.ended != "exited":
            return None
        try:
            result = self.connection.run(
                ["docker", "wait", self.container], timeout=DOCKER_COMMAND_TIMEOUT_S, check=False
            )
        except RemoteError:
            return None  # still running after all: the log stream was cut, not ended
        text = result.stdout.decode(errors="replace").strip()
        if result.exit_code == 0 and text.lstrip("-").isdigit():
            return ExitStatus(int(text), self.oom_killed())
        stderr = result.stderr.decode(errors="replace").strip()
        if NO_SUCH_CONTAINER in stderr:
            self.events.put(ContainerMissing(self.node.node, stderr, time.monotonic()))
        return None

    def oom_killed(self) -> bool | None:
        """docker's State.OOMKilled of the exited container; None when it cannot be read."""
        try:
            result = self.connection.run(
                ["docker", "inspect", "--format", "{{.State.OOMKilled}}", self.container],
                timeout=DOCKER_COMMAND_TIMEOUT_S,
                check=False,
            )
        except RemoteError:
            return None
        return {"true": True, "false": False}.get(result.stdout.decode(errors="replace").strip())

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.thread is not None:
            self.thread.join(FOLLOWER_JOIN_S)


def wait_until_ready(
    plan: Plan,
    gate: ReadinessGate,
    *,
    timeout_s: float | None = None,
    connection_for: ConnectionFactory = cached_connection,
) -> GateResult:
    """Follow every node's container until `gate` says ready (or raises errors.BootFailed).

    `timeout_s` defaults to the recipe's readiness timeout; it counts from the gate's start.
    """
    timeout = plan.readiness_timeout_s if timeout_s is None else timeout_s
    events: queue.Queue[GateEvent] = queue.Queue()
    stop = threading.Event()
    nodes = plan.nodes

    def attach(node: NodePlan) -> _Follower:
        try:
            follower = _Follower(node, connection_for, stop, events, timeout)
            follower.start()
        except RemoteError as error:
            raise type(error)(
                f"node {node.node}: following its container's log: {error}"
            ) from error
        return follower

    followers: list[_Follower] = []
    try:
        with ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix="readiness") as pool:
            futures = [pool.submit(attach, node) for node in nodes]
        errors = []
        for future in futures:
            error = future.exception()
            if error is None:
                followers.append(future.result())
            else:
                errors.append(error)
        if errors:
            raise errors[0]
        return gate.wait(
            events,
            endpoint=plan.endpoint,
            served_model_name=plan.served_model_name,
            timeout_s=timeout,
            api_key=plan.api_key,
        )
    finally:
        stop.set()
        for follower in followers:
            follower.close()
