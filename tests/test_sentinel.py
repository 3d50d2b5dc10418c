"""The sentinel's probe verdicts and state machine (sparkdeploy.steps.sentinel), on a fake clock
with scripted probe results: no false alarm on a single failed probe, a fault declared within
15 s, a link back within 30 s left alone and one down for longer declared; and the keep-alive
HTTP connection its probes use."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
import yaml

from sparkdeploy.remote.engine_http import KeepAlive
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import Plan, make_plan
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.steps.sentinel import (
    PROBE_INTERVAL_S,
    UNREACHABLE_GRACE_S,
    Liveness,
    Outcome,
    ProbeResult,
    Verdict,
    WatchRecord,
    classify,
    watch,
)

ROOT = Path(__file__).resolve().parent.parent
PLAN = make_plan(
    load_recipe(ROOT / "recipes" / "real-lab-2x" / "recipe.toml"),
    load_cluster(ROOT / "clusters" / "dgx-spark-4.toml"),
)
HEAD, WORKER = (node.node for node in PLAN.nodes)
OK = ProbeResult(Outcome.OK)
FAILED = ProbeResult(Outcome.FAILED, HEAD, "requests_failing", "answered 500")
UNREACHABLE = ProbeResult(Outcome.UNREACHABLE, WORKER, "link_lost", "no answer")
GONE = ProbeResult(Outcome.GONE, HEAD, "gone", "no container")
DETECT_BUDGET_S = 15.0


def test_a_probe_is_judged_from_the_completion_and_the_containers() -> None:
    running = {HEAD: ("running", 0), WORKER: ("running", 0)}
    assert classify(PLAN, None, running, {}).outcome is Outcome.OK
    worker_dead = classify(PLAN, "refused", {**running, WORKER: ("exited", 137)}, {})
    assert (worker_dead.outcome, worker_dead.node, worker_dead.kind) == (
        Outcome.FAILED,
        WORKER,
        "worker_died",
    )
    assert "exit code 137" in worker_dead.cause
    assert "refused" in worker_dead.cause
    head_dead = classify(PLAN, "refused", {**running, HEAD: ("exited", 0)}, {})
    assert (head_dead.node, head_dead.kind) == (HEAD, "head_exited")
    failing = classify(PLAN, "answered 500", running, {})
    assert (failing.outcome, failing.kind) == (Outcome.FAILED, "requests_failing")
    assert classify(PLAN, None, {HEAD: None, WORKER: None}, {}).outcome is Outcome.GONE
    removed = classify(PLAN, None, {**running, WORKER: None}, {})
    assert (removed.outcome, removed.kind) == (Outcome.FAILED, "container_removed")


def test_a_node_that_does_not_answer_is_unreachable_not_dead_unless_another_shows_a_death() -> None:
    head_up = {HEAD: ("running", 0)}
    lost = classify(PLAN, "timed out", head_up, {WORKER: "no answer"})
    assert (lost.outcome, lost.node, lost.kind) == (Outcome.UNREACHABLE, WORKER, "link_lost")
    # The engine answers through every rank: the worker serves, whatever the ops host sees.
    assert classify(PLAN, None, head_up, {WORKER: "no answer"}).outcome is Outcome.OK
    dead = classify(PLAN, "refused", {HEAD: ("exited", 0)}, {WORKER: "no answer"})
    assert (dead.outcome, dead.kind) == (Outcome.FAILED, "head_exited")


class Recorder:
    """A Reporter that keeps what it was told, at the fake clock's time."""

    def __init__(self, clock: Callable[[], float], busy_until: float = float("-inf")) -> None:
        self.clock = clock
        self.busy_until = busy_until
        self.events: list[tuple[float, str]] = []
        self.lines: list[str] = []
        self.probes: list[tuple[Outcome, str, str]] = []

    def busy(self, plan: Plan) -> str | None:
        return "a deploy holds node1" if self.clock() < self.busy_until else None

    def unhealthy(self, plan: Plan, result: ProbeResult, cause: str) -> None:
        self.events.append((self.clock(), f"unhealthy {result.kind}"))

    def recovered(self, plan: Plan) -> None:
        self.events.append((self.clock(), "recovered"))

    def probed(self, plan: Plan, result: ProbeResult, before: str, after: str) -> None:
        self.probes.append((result.outcome, before, after))

    def log(self, message: str) -> None:
        self.lines.append(message)


def run_script(
    result_at: Callable[[float], ProbeResult],
    *,
    until: float,
    probe_s: float = 0.05,
    start: float = 0.0,
    busy_until: float = float("-inf"),
) -> tuple[Recorder, WatchRecord]:
    """watch() on a fake clock starting at `start`, each probe taking probe_s and answering
    result_at(its start time), until the clock reaches `until`."""
    now = [start]

    def clock() -> float:
        return now[0]

    def probe() -> ProbeResult:
        result = result_at(now[0])
        now[0] += probe_s
        return result

    def wait(delay: float) -> bool:
        now[0] += max(0.0, delay)
        return now[0] >= until

    recorder = Recorder(clock, busy_until)
    record = WatchRecord(PLAN.deployment_id)
    watch(PLAN, probe, recorder, record, wait=wait, clock=clock)
    return recorder, record


def test_one_failed_probe_among_good_ones_raises_no_alarm() -> None:
    recorder, record = run_script(lambda t: FAILED if 30 <= t < 31 else OK, until=20 * 60)
    assert recorder.events == []
    assert record.probes == pytest.approx(20 * 60 / PROBE_INTERVAL_S, abs=2)
    # Nor two in a row (6 s is not reached), nor a slow one every minute.
    recorder, _ = run_script(lambda t: FAILED if 30 <= t < 34 else OK, until=120)
    assert recorder.events == []


@pytest.mark.parametrize("probe_s", [0.05, 2.5], ids=["fails-fast", "times-out"])
@pytest.mark.parametrize("phase", [0.0, 0.5, 1.5, 2.9])
def test_a_fault_is_declared_once_within_15_s(phase: float, probe_s: float) -> None:
    fault = 60.0 + phase
    recorder, _ = run_script(lambda t: FAILED if t >= fault else OK, until=180, probe_s=probe_s)
    [(when, what)] = recorder.events
    assert what == "unhealthy requests_failing"
    assert 6.0 <= when - fault <= DETECT_BUDGET_S, when - fault


def test_recovered_once_after_two_good_probes_and_declared_again_if_it_dies_again() -> None:
    def result_at(t: float) -> ProbeResult:
        return FAILED if 10 <= t < 40 or t >= 100 else OK

    recorder, _ = run_script(result_at, until=150)
    kinds = [what for _, what in recorder.events]
    assert kinds == ["unhealthy requests_failing", "recovered", "unhealthy requests_failing"]
    recovered_at = recorder.events[1][0]
    assert 40 < recovered_at <= 40 + 2 * PROBE_INTERVAL_S + 0.1
    # Every probe reaches the reporter (status's last probe), with the liveness it moved.
    changes = [(before, after) for _, before, after in recorder.probes if before != after]
    declared = [("healthy", "suspect"), ("suspect", "unhealthy")]
    assert changes == [*declared, ("unhealthy", "healthy"), *declared]
    assert len(recorder.probes) == 150 / PROBE_INTERVAL_S


def test_a_link_back_within_30_s_is_left_alone_and_one_that_stays_down_is_declared() -> None:
    recorder, _ = run_script(lambda t: UNREACHABLE if 60 <= t < 90 else OK, until=300)
    assert recorder.events == []
    recorder, _ = run_script(lambda t: UNREACHABLE if t >= 60 else OK, until=300)
    [(when, what)] = recorder.events
    assert what == "unhealthy link_lost"
    assert UNREACHABLE_GRACE_S <= when - 60 <= UNREACHABLE_GRACE_S + PROBE_INTERVAL_S + 0.1


def test_a_node_that_comes_back_showing_a_dead_engine_is_declared_at_once() -> None:
    """Unreachable probes do not count as failures, but the engine found dead once the link is
    back is judged on its own clock."""
    recorder, _ = run_script(
        lambda t: UNREACHABLE if 60 <= t < 80 else FAILED if t >= 80 else OK, until=200
    )
    [(when, what)] = recorder.events
    assert what == "unhealthy requests_failing"
    assert 80 + 6 <= when <= 80 + DETECT_BUDGET_S


def test_no_verdict_while_a_deploy_is_busy_with_it_then_one() -> None:
    recorder, _ = run_script(lambda t: FAILED if t >= 30 else OK, until=200, busy_until=100)
    [(when, _what)] = recorder.events
    assert 100 <= when <= 100 + 10 + PROBE_INTERVAL_S
    assert any("not judged while a deploy holds node1" in line for line in recorder.lines)


def test_a_deployment_gone_ends_its_watch_without_an_event() -> None:
    recorder, record = run_script(lambda t: GONE if t >= 30 else OK, until=300)
    assert recorder.events == []
    assert record.gone
    assert recorder.probes[-1] == (Outcome.GONE, "healthy", "healthy")  # status forgets it
    assert record.probes == pytest.approx(30 / PROBE_INTERVAL_S + 1, abs=1)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keeps the connection open, as uvicorn does
    peers: ClassVar[list[tuple[str, int]]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.peers.append(self.client_address)
        body = b'{"choices": [{"text": "!"}]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def engine() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    _Handler.peers = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_keep_alive_reuses_one_connection_and_survives_the_server_closing_it(
    engine: ThreadingHTTPServer,
) -> None:
    http = KeepAlive(f"http://127.0.0.1:{engine.server_address[1]}", timeout=2)
    for _ in range(3):
        assert http.request("POST", "/v1/completions", json_body={}).status == 200
    assert len(set(_Handler.peers)) == 1  # one source port: one connection
    # The idle connection dies (as when the server's keep-alive timeout closes it): the
    # request is sent again on a new one.
    assert http._connection is not None
    assert http._connection.sock is not None
    http._connection.sock.shutdown(2)
    assert http.request("POST", "/v1/completions", json_body={}).status == 200
    assert len(set(_Handler.peers)) == 2
    http.close()


@pytest.mark.parametrize(
    ("prefect_file", "cluster"), [("prefect.yaml", "dgx-spark-4"), ("lab/prefect.yaml", "lab")]
)
def test_one_sentinel_per_cluster_is_kept_alive_by_its_schedule(
    prefect_file: str, cluster: str
) -> None:
    """Each run has ended when the next is due (run_for_s counts from the scheduled time), and
    a run due while one goes is cancelled: never two sentinels on a cluster."""
    deployments = yaml.safe_load((ROOT / prefect_file).read_text())["deployments"]
    [sentinel] = [d for d in deployments if d["entrypoint"] == "flows/sentinel.py:sentinel"]
    assert sentinel["name"] == cluster
    assert sentinel["parameters"]["cluster"] == cluster
    [schedule] = sentinel["schedules"]
    assert sentinel["parameters"]["run_for_s"] < schedule["interval"]
    assert sentinel["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}


def test_the_state_reads_suspect_from_the_first_bad_probe_even_at_time_zero() -> None:
    liveness = Liveness()
    assert liveness.observe(FAILED, 0.0, 0.1) is Verdict.NONE
    assert liveness.state == "suspect"
    assert liveness.observe(OK, 3.0, 3.1) is Verdict.NONE
    assert liveness.state == "healthy"
