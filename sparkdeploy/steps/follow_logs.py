"""Readiness of a booted deployment: every container's log, followed over SSH, fed to the gate.

    gate = gate_for(plan)
    result = wait_until_ready(plan, gate)      # GateResult, or errors.BootFailed

For each node, `docker logs --follow <container>` streams over that node's SSH connection (stdout
and stderr merged) into the gate's queue; when a log ends because its container stopped,
`docker wait <container>` supplies the exit code (or says there is no such container) and
`docker inspect` docker's State.OOMKilled, so an exit 137 is named an OOM kill only when the
kernel says so. The
gate decides (sparkdeploy.steps.readiness_gate); the streams are stopped and their channels closed
however it ends, and `gate.timeline` stays readable after a failure. Boot (starting the containers)
is not done here.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from sparkdeploy.errors import RemoteError
from sparkdeploy.model.plan import NodePlan, Plan
from sparkdeploy.remote.ssh import Connection, LineStream, SshTarget, cached_connection
from sparkdeploy.remote.targets import node_target
from sparkdeploy.steps.readiness_gate import (
    ContainerMissing,
    ExitStatus,
    GateEvent,
    GateResult,
    ReadinessGate,
    follow_lines,
)
from sparkdeploy.vllm.markers import HEADLESS_WORKER_JOINED

# The log streams outlive the gate's own timeout by this much, so the gate always decides first.
STREAM_MARGIN_S = 30.0
DOCKER_COMMAND_TIMEOUT_S = 15.0
FOLLOWER_JOIN_S = 2.0
NO_SUCH_CONTAINER = "No such container"

ConnectionFactory = Callable[[SshTarget], Connection]


def gate_for(plan: Plan, *, started_at: float | None = None) -> ReadinessGate:
    """The gate for this plan's nodes and markers; `started_at` (time.monotonic()) defaults to
    now, and the timeline counts from it."""
    head = plan.head
    # mp workers (--headless) print their join; Ray workers print nothing of vLLM's.
    ray = head.serve_exec is not None
    return ReadinessGate(
        head=head.node,
        workers=[node.node for node in plan.workers],
        boot_markers=plan.boot_markers,
        worker_markers=() if ray else (HEADLESS_WORKER_JOINED,),
        failure_markers=plan.failure_markers,
        # the head's gloo "Connection closed by peer [ip]" names a dead worker by this
        node_of_ip={node.fabric_ip: node.node for node in plan.workers},
        started_at=started_at,
    )


class _Follower:
    """One node's `docker logs --follow`, feeding the gate's queue from a thread."""

    def __init__(
        self,
        node: NodePlan,
        connection: Connection,
        stop: threading.Event,
        events: queue.Queue[GateEvent],
    ) -> None:
        self.node = node
        self.connection = connection
        self.stop = stop
        self.events = events
        self.stream: LineStream | None = None
        self.thread: threading.Thread | None = None

    @property
    def container(self) -> str:
        return self.node.container.name

    def start(self, timeout_s: float) -> None:
        lifetime_s = timeout_s + STREAM_MARGIN_S
        # `timeout` bounds the follower on the node too: closing the SSH channel alone leaves
        # `docker logs` running until its container prints again.
        self.stream = self.connection.stream_lines(
            ["timeout", f"{lifetime_s:.0f}", "docker", "logs", "--follow", self.container],
            timeout=lifetime_s,
            stop=self.stop,
        )
        self.thread = follow_lines(self.events, self.node.node, self.stream, self.exit_status)

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
            follower = _Follower(node, connection_for(node_target(node)), stop, events)
            follower.start(timeout)
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
