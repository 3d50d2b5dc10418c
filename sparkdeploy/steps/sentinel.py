"""The sentinel: every running deployment probed every few seconds, so that a dead head, a dead
worker or an engine that fails requests is noticed within 15 s, with one unhealthy event on the
transition (the watchdog's event: the repair automation and the notification act on it).

One probe is what real vLLM cannot fool: its /health stays 200 for over a minute after a worker
dies (docs/real-engine.md), while a request fails at once. So a probe is a one-token completion
(max_tokens 1, temperature 0, a short timeout) over an HTTP connection kept open, and each
node's container state (`docker inspect`) over an SSH connection kept open: no handshake per
probe, and a probe that costs the engine one decode step.

A probe is OK, FAILED (the engine refused or failed the request while every node answered, or
a container stopped or vanished), UNREACHABLE (a node did not answer and the engine did not
either: a link down is not an engine dead), or GONE (no container of the deployment is left on
any node: torn down or replaced). Liveness turns probes into a verdict: unhealthy after probes
failed without a success for FAILING_FOR_S (at least MIN_FAILED_PROBES of them), or after a node
stayed unreachable for UNREACHABLE_GRACE_S, so that a link back within 30 s is not redeployed;
healthy again after RECOVERED_AFTER good probes. Before declaring it unhealthy the caller asks
whether a deploy or a teardown is busy with the deployment (a boot, a repair or a teardown looks
like a death from outside): then it waits.
"""

from __future__ import annotations

import contextvars
import dataclasses
import http.client
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import paramiko

from sparkdeploy.errors import RemoteError
from sparkdeploy.remote.engine_http import COMPLETION_PROMPT, KeepAlive
from sparkdeploy.remote.ssh import Connection, connect
from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.spec.plan import Plan

# Probe every 3 s; a failure shows within one probe (refused, 5xx, a container exited: well under
# a second; a hung engine: the timeout), so a fault is declared 6 s after the first failed probe
# starts, at most 3 s after the fault: about 10 s in all, 15 s at worst with timeouts.
PROBE_INTERVAL_S = 3.0
COMPLETION_TIMEOUT_S = 2.5
COMMAND_TIMEOUT_S = 2.5
# A new SSH connection (after a link came back) must not hold a probe longer than the others.
CONNECT_TIMEOUT_S = 2.5
FAILING_FOR_S = 6.0
MIN_FAILED_PROBES = 2
RECOVERED_AFTER = 2
# A link that comes back within 30 s must not cost a redeploy; one down for longer does.
UNREACHABLE_GRACE_S = 45.0
# How often the deployments to watch are read again (they come and go).
REFRESH_S = 30.0
# While a deploy or teardown is busy with a deployment, how long before asking Prefect again.
BUSY_RECHECK_S = 10.0


class Outcome(StrEnum):
    OK = "ok"
    FAILED = "failed"
    UNREACHABLE = "unreachable"
    GONE = "gone"


@dataclass(frozen=True)
class ProbeResult:
    outcome: Outcome
    node: str = ""  # the node at fault
    kind: str = ""  # head_exited, worker_died, container_removed, requests_failing, link_lost
    cause: str = ""


ContainerState = tuple[str, int] | None  # (docker's State.Status, its exit code); None: absent


def classify(
    plan: Plan,
    completion_error: str | None,
    states: Mapping[str, ContainerState],
    unreachable: Mapping[str, str],
) -> ProbeResult:
    """One probe's outcome from the completion's error (None: it answered), the containers'
    states of the nodes that answered, and why the others did not."""
    head = plan.head.node
    if not unreachable and all(state is None for state in states.values()):
        return ProbeResult(Outcome.GONE, head, "gone", "no container of the deployment is left")
    stopped = {
        node: f"{node}'s container is {state[0]} (exit code {state[1]})"
        for node, state in states.items()
        if state is not None and state[0] != "running"
    }
    absent = [node for node, state in states.items() if state is None]
    also = f"; {completion_error}" if completion_error else ""
    if stopped:
        workers = [node for node in stopped if node != head]
        node, kind = (workers[0], "worker_died") if workers else (head, "head_exited")
        return ProbeResult(Outcome.FAILED, node, kind, "; ".join(stopped.values()) + also)
    if absent:
        return ProbeResult(
            Outcome.FAILED,
            absent[0],
            "container_removed",
            f"{absent[0]} has no container of the deployment (removed by hand?){also}",
        )
    if completion_error is None:
        # The engine answered through every rank: a node the ops host cannot reach still serves.
        return ProbeResult(Outcome.OK)
    if unreachable:
        node, why = next(iter(unreachable.items()))
        return ProbeResult(
            Outcome.UNREACHABLE, node, "link_lost", f"{node} cannot be reached: {why}{also}"
        )
    return ProbeResult(Outcome.FAILED, head, "requests_failing", completion_error)


class Verdict(StrEnum):
    NONE = "none"
    UNHEALTHY = "unhealthy"  # due: the caller declares it (declared()) unless a deploy is busy
    RECOVERED = "recovered"


class Liveness:
    """One deployment's state machine: healthy, suspect after a bad probe, unhealthy once the
    bad probes last (FAILING_FOR_S, or UNREACHABLE_GRACE_S for a node that does not answer),
    healthy again after RECOVERED_AFTER good probes. Times are the caller's clock's."""

    def __init__(
        self,
        *,
        failing_for_s: float = FAILING_FOR_S,
        min_failed_probes: int = MIN_FAILED_PROBES,
        unreachable_grace_s: float = UNREACHABLE_GRACE_S,
        recovered_after: int = RECOVERED_AFTER,
    ) -> None:
        self._failing_for_s = failing_for_s
        self._min_failed = min_failed_probes
        self._grace_s = unreachable_grace_s
        self._recovered_after = recovered_after
        self.unhealthy = False
        self._failed = 0
        self._failed_since: float | None = None
        self._unreachable_since: float | None = None
        self._successes = 0

    @property
    def state(self) -> str:
        if self.unhealthy:
            return "unhealthy"
        bad = self._failed_since is not None or self._unreachable_since is not None
        return "suspect" if bad else "healthy"

    def bad_for(self, now: float) -> float:
        """How long the current run of bad probes has lasted (0 when the last was good)."""
        starts = [t for t in (self._failed_since, self._unreachable_since) if t is not None]
        return now - min(starts) if starts else 0.0

    def observe(self, result: ProbeResult, started: float, now: float) -> Verdict:
        """A probe that started at `started` and ended at `now`."""
        if result.outcome is Outcome.OK:
            self._failed, self._failed_since, self._unreachable_since = 0, None, None
            if not self.unhealthy:
                return Verdict.NONE
            self._successes += 1
            if self._successes < self._recovered_after:
                return Verdict.NONE
            self.unhealthy, self._successes = False, 0
            return Verdict.RECOVERED
        self._successes = 0
        if result.outcome is Outcome.UNREACHABLE:
            # Only consecutive answered failures count: a node that does not answer says
            # nothing about the engine, and its own clock is the grace.
            self._failed, self._failed_since = 0, None
            if self._unreachable_since is None:
                self._unreachable_since = started
        elif result.outcome is Outcome.FAILED:
            self._failed += 1
            if self._failed_since is None:
                self._failed_since = started
        if self.unhealthy:
            return Verdict.NONE
        failing = (
            self._failed_since is not None
            and self._failed >= self._min_failed
            and now - self._failed_since >= self._failing_for_s
        )
        unreachable = (
            self._unreachable_since is not None and now - self._unreachable_since >= self._grace_s
        )
        return Verdict.UNHEALTHY if failing or unreachable else Verdict.NONE

    def declared(self) -> None:
        """The unhealthy verdict was acted on (its event emitted): none again until recovered."""
        self.unhealthy = True


class Probe:
    """One deployment's probe, holding its connections: the engine's over HTTP keep-alive, and
    one SSH connection per node of its own (not the process's cache, which other code closes),
    each node asked on a thread of its own so that one node down does not hold the others."""

    def __init__(
        self,
        plan: Plan,
        *,
        completion_timeout_s: float = COMPLETION_TIMEOUT_S,
        command_timeout_s: float = COMMAND_TIMEOUT_S,
    ) -> None:
        self.plan = plan
        self._command_timeout_s = command_timeout_s
        self._http = KeepAlive(plan.endpoint, timeout=completion_timeout_s)
        self._targets = {
            node: dataclasses.replace(target, connect_timeout_s=CONNECT_TIMEOUT_S)
            for node, target in plan_targets(plan).items()
        }
        self._container_names = {node.node: node.container.name for node in plan.nodes}
        self._connections: dict[str, Connection] = {}
        # A node's check still under way from an earlier probe is awaited, never doubled.
        self._pending: dict[str, Future[ContainerState]] = {}
        self._pool = ThreadPoolExecutor(
            max_workers=len(self._targets), thread_name_prefix=f"probe-{plan.deployment_id}"
        )

    def __call__(self) -> ProbeResult:
        deadline = time.monotonic() + self._command_timeout_s
        for node in self._targets:
            pending = self._pending.get(node)
            if pending is None or pending.done():
                self._pending[node] = self._pool.submit(self._container_state, node)
        completion_error = self._completion()
        states: dict[str, ContainerState] = {}
        unreachable: dict[str, str] = {}
        for node, future in self._pending.items():
            try:
                states[node] = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                unreachable[node] = f"no answer over SSH within {self._command_timeout_s} s"
            except (RemoteError, OSError, EOFError, paramiko.SSHException) as error:
                unreachable[node] = str(error)
        return classify(self.plan, completion_error, states, unreachable)

    def _completion(self) -> str | None:
        body = {
            "model": self.plan.served_model_name,
            "prompt": COMPLETION_PROMPT,
            "max_tokens": 1,
            "temperature": 0,
        }
        what = "POST /v1/completions"
        try:
            reply = self._http.request(
                "POST", "/v1/completions", json_body=body, api_key=self.plan.api_key
            )
        except (OSError, http.client.HTTPException) as error:
            return f"{what}: {type(error).__name__}: {error}"
        if reply.status != 200:
            return f"{what} answered {reply.status}: {reply.body[:200].decode(errors='replace')}"
        try:
            choices = reply.json()["choices"]
        except (ValueError, KeyError, TypeError) as error:
            return f"{what}: not a completion ({error})"
        return None if choices else f"{what} answered no choice"

    def _connection(self, node: str) -> Connection:
        """The node's kept connection; a new one (one attempt: the next probe is the retry)
        when there is none or it died."""
        connection = self._connections.get(node)
        if connection is None or not connection.is_active:
            if connection is not None:
                connection.close()
            connection = connect(self._targets[node], attempts=1)
            self._connections[node] = connection
        return connection

    def _container_state(self, node: str) -> ContainerState:
        result = self._connection(node).run(
            [
                *("docker", "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}"),
                self._container_names[node],
            ],
            timeout=self._command_timeout_s,
            check=False,
        )
        if result.exit_code != 0:
            stderr = result.stderr.decode(errors="replace").strip()
            if "no such object" in stderr.lower() or "no such container" in stderr.lower():
                return None
            raise RemoteError(f"node {node}: docker inspect exited {result.exit_code}: {stderr}")
        try:
            status, code = result.stdout.decode().split()
            return status, int(code)
        except ValueError as error:
            raise RemoteError(
                f"node {node}: docker inspect answered {result.stdout[:200]!r}, not a state"
            ) from error

    def close(self) -> None:
        self._http.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for connection in self._connections.values():
            connection.close()


class Reporter(Protocol):
    """What the sentinel tells the world (tasks/sentinel.py: Prefect's events and log)."""

    def busy(self, plan: Plan) -> str | None:
        """Why a deploy or teardown is busy with the deployment (then no verdict), or None."""
        ...

    def unhealthy(self, plan: Plan, result: ProbeResult, cause: str) -> None: ...

    def recovered(self, plan: Plan) -> None: ...

    def probed(self, plan: Plan, result: ProbeResult, before: str, after: str) -> None:
        """A probe's outcome, the deployment's liveness state before and after it (status
        shows the last one: sparkdeploy.steps.sentinel_record)."""
        ...

    def log(self, message: str) -> None: ...


ProbeFn = Callable[[], ProbeResult]


@dataclass
class WatchRecord:
    """What one deployment's watch did, for the run's summary and the cost bench."""

    deployment_id: str
    probes: int = 0
    unhealthy_events: int = 0
    recovered_events: int = 0
    gone: bool = False


def watch(
    plan: Plan,
    probe: ProbeFn,
    reporter: Reporter,
    record: WatchRecord,
    *,
    wait: Callable[[float], bool],
    clock: Callable[[], float] = time.monotonic,
    interval_s: float = PROBE_INTERVAL_S,
    liveness: Liveness | None = None,
) -> None:
    """Probe the deployment every interval_s until `wait` says stop (it returns True, as
    threading.Event.wait does) or the deployment is gone; emit on transitions only."""
    liveness = liveness or Liveness()
    busy_until = float("-inf")
    next_at = clock()
    while True:
        started = clock()
        result = probe()
        now = clock()
        record.probes += 1
        if result.outcome is Outcome.GONE:
            reporter.probed(plan, result, liveness.state, liveness.state)
            reporter.log(f"{plan.deployment_id}: gone ({result.cause}); no longer watched")
            record.gone = True
            return
        before = liveness.state
        verdict = liveness.observe(result, started, now)
        if verdict is Verdict.UNHEALTHY and now >= busy_until:
            busy = reporter.busy(plan)
            if busy is None:
                bad_for = liveness.bad_for(now)
                cause = f"{result.cause} (probes bad for {bad_for:.1f} s)"
                reporter.unhealthy(plan, result, cause)
                liveness.declared()
                record.unhealthy_events += 1
            else:
                reporter.log(f"{plan.deployment_id}: not judged while {busy}")
                busy_until = now + BUSY_RECHECK_S
        elif verdict is Verdict.RECOVERED:
            reporter.recovered(plan)
            record.recovered_events += 1
        reporter.probed(plan, result, before, liveness.state)
        if liveness.state != before:
            reporter.log(f"{plan.deployment_id}: {before} -> {liveness.state}: {result.cause}")
        next_at = max(next_at + interval_s, clock())
        if wait(next_at - clock()):
            return


@dataclass
class _Watched:
    thread: threading.Thread
    stop: threading.Event
    probe: Probe
    record: WatchRecord


def run_sentinel(
    read_plans: Callable[[], list[Plan]],
    reporter: Reporter,
    *,
    run_for_s: float,
    refresh_s: float = REFRESH_S,
) -> list[WatchRecord]:
    """Watch every deployment read_plans() names, each on a thread of its own, reading them
    again every refresh_s (new ones watched, gone ones dropped), for run_for_s; the records of
    every deployment watched."""
    watched: dict[str, _Watched] = {}
    records: list[WatchRecord] = []
    deadline = time.monotonic() + run_for_s
    try:
        while True:
            try:
                plans = {plan.deployment_id: plan for plan in read_plans()}
            except (RemoteError, OSError) as error:
                # A node that cannot be listed (its link down) proves nothing: keep watching
                # what was watched, whose probes judge it.
                reporter.log(f"cannot read the cluster's deployments this time: {error}")
                plans = {dep: w.probe.plan for dep, w in watched.items()}
            for dep in [dep for dep, w in watched.items() if dep not in plans or w.record.gone]:
                entry = watched.pop(dep)
                if not entry.record.gone:
                    reporter.log(f"{dep}: gone (no longer on the cluster); no longer watched")
                _stop_watch(entry)
            for dep, plan in plans.items():
                if dep not in watched:
                    watched[dep] = _start_watch(plan, reporter)
                    records.append(watched[dep].record)
                    reporter.log(f"{dep}: watched ({plan.recipe} at {plan.endpoint})")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return records
            time.sleep(min(refresh_s, remaining))
    finally:
        for entry in watched.values():
            _stop_watch(entry)


def _start_watch(plan: Plan, reporter: Reporter) -> _Watched:
    probe = Probe(plan)
    record = WatchRecord(plan.deployment_id)
    stop = threading.Event()
    # In the caller's context (a copy per thread): Prefect's settings and run context there
    # (its API, the run logger's run) are the watch's too.
    context = contextvars.copy_context()
    thread = threading.Thread(
        target=context.run,
        args=(watch, plan, probe, reporter, record),
        kwargs={"wait": stop.wait},
        name=f"sentinel-{plan.deployment_id}",
        daemon=True,
    )
    thread.start()
    return _Watched(thread, stop, probe, record)


def _stop_watch(entry: _Watched) -> None:
    """Its thread told to stop (it ends at its next wait, or has ended: gone), and its probe
    closed once the thread is done with it."""
    entry.stop.set()
    entry.thread.join(timeout=COMPLETION_TIMEOUT_S + COMMAND_TIMEOUT_S + PROBE_INTERVAL_S)
    entry.probe.close()
