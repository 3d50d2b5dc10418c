"""The status view: each deployment's health, healthy since, the sentinel's last probe, last
fault, repairs this hour, last smoke test and bytes on each node, derived from fake event,
flow-run and Variable records and rendered (unit test, no Prefect server); the sentinel's record
written at most every 30 s and on a transition; the node script's byte count."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prefect import flow, tags
from prefect.client.orchestration import SyncPrefectClient
from prefect.events import emit_event

import tasks.sentinel
from lab.testing.local_node import LocalNode
from sparkdeploy.node.compose_model import CACHEDIR_SIGNATURE, KEY_FILE, KEY_LINE_PREFIX
from sparkdeploy.node.prune import MANIFEST_SUFFIX
from sparkdeploy.node.usage import measure
from sparkdeploy.remote.prefect_api import SingleAttemptHttpxClient
from sparkdeploy.report.history import (
    Fault,
    History,
    LastProbe,
    Sentinel,
    SentinelRecord,
    fault_of,
    read_history,
    read_sentinel,
    repairs_by_deployment,
    sentinel_variable,
    smoke_text,
)
from sparkdeploy.report.text_table import text_table
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.events import Health, health_event
from sparkdeploy.spec.plan import make_plan
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.steps.repair_budget import REPAIR_TAG, deployment_tag
from sparkdeploy.steps.sentinel import Outcome, ProbeResult
from sparkdeploy.steps.sentinel_record import CAUSE_CHARS, RECORD_EVERY_S, ProbeLedger
from sparkdeploy.steps.status import DeploymentStatus, NodeContainer
from sparkdeploy.steps.status_view import (
    COLUMNS,
    NodeBytes,
    StatusReport,
    ask_usage,
    deployment_row,
    usage_requests,
)
from tasks.sentinel import write_record

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = load_cluster(ROOT / "clusters" / "dgx-spark-4.toml")
PLAN = make_plan(load_recipe(ROOT / "recipes" / "real-lab-2x" / "recipe.toml"), CLUSTER)
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
STARTED = datetime(2026, 1, 1, 9, 31, tzinfo=UTC)
CONTAINERS = [
    NodeContainer("dgx1", 0, "c0", "running", 0, "2026-01-01T09:30:00.123456789Z"),
    NodeContainer("dgx2", 1, "c1", "running", 0, "2026-01-01T09:31:00Z"),
]
SERVING = DeploymentStatus(PLAN.deployment_id, PLAN.recipe, CONTAINERS, PLAN, True, "ready")
SCHEDULE_OFF = "the sentinel/dgx-spark-4 schedule is off"


def minutes_ago(minutes: float) -> datetime:
    return NOW - timedelta(minutes=minutes)


@dataclass(frozen=True)
class FakeEvent:
    event: str
    occurred: datetime
    payload: dict[str, Any]


@dataclass(frozen=True)
class FakeRun:
    start_time: datetime | None
    tags: list[str] = field(default_factory=list)


def test_the_last_smoke_test_reads_from_its_artifact() -> None:
    assert smoke_text(
        "Smoke test of 'x' at http://h:8000 (r): every check passed", minutes_ago(62), NOW
    ) == ("passed, 1 h 2 min ago")
    assert smoke_text("Smoke test of 'x' at http://h:8000 (r): 2 check(s) FAILED", NOW, NOW) == (
        "FAILED (2 check(s) FAILED), 0 s ago"
    )
    assert smoke_text(None, None, NOW) == "none yet"


def test_a_deployment_is_whole_from_its_last_container_start_and_says_which_one_stopped() -> None:
    assert SERVING.started == STARTED
    assert SERVING.health_text == "healthy"
    stopped = [CONTAINERS[0], NodeContainer("dgx2", 1, "c1", "exited", 137, "")]
    down = DeploymentStatus(PLAN.deployment_id, PLAN.recipe, stopped, PLAN, False, "refused")
    assert down.started is None
    assert down.health_text == "NOT healthy: dgx2's container exited (137); refused"


def test_the_last_fault_comes_from_the_last_unhealthy_event_with_its_cause() -> None:
    event = FakeEvent(
        "sparkdeploy.deployment.unhealthy",
        minutes_ago(5),
        {"node": "dgx2", "kind": "worker_died", "cause": "dgx2 exited with code 137"},
    )
    fault = fault_of(event)
    assert fault == Fault(minutes_ago(5), "dgx2", "worker_died", "dgx2 exited with code 137")
    history = History("none yet", fault, None, ())
    assert history.fault_text(NOW) == "worker_died on dgx2, 5 min ago: dgx2 exited with code 137"
    assert History("none yet", None, None, ()).fault_text(NOW) == "none recorded"
    unnamed = fault_of(FakeEvent("sparkdeploy.deployment.unhealthy", NOW, {}))
    assert (unnamed.node, unnamed.kind, unnamed.cause) == ("?", "?", "no cause given")


def fault_at(minutes: float) -> Fault:
    return Fault(minutes_ago(minutes), "dgx2", "worker_died", "dgx2 exited (137)")


@pytest.mark.parametrize(
    ("fault", "recovered", "healthy", "expected"),
    [
        # No fault: healthy since its containers started.
        (None, None, True, "2 h 29 min ago (2026-01-01 09:31 UTC), its start: no fault since"),
        # A fault before its start (a repair redeployed it): its start still.
        (fault_at(200), None, True, "2 h 29 min ago (2026-01-01 09:31 UTC), its start"),
        # A fault since its start, then a healthy event: since that event.
        (fault_at(30), minutes_ago(20), True, "20 min ago (2026-01-01 11:40 UTC), recovered"),
        # A fault since its start and no healthy event after it: it serves, since when unknown.
        (fault_at(30), None, True, "unknown: it serves now, but no healthy event came after"),
        # Not healthy now: since its fault when one is recorded.
        (fault_at(3), None, False, "not healthy: unhealthy since 3 min ago (2026-01-01 11:57"),
        (None, None, False, "not healthy now"),
    ],
)
def test_healthy_since_is_derived_from_the_fault_its_recovery_and_the_containers_start(
    fault: Fault | None, recovered: datetime | None, healthy: bool, expected: str
) -> None:
    history = History("none yet", fault, recovered, ())
    assert history.healthy_since_text(healthy, STARTED, NOW).startswith(expected)


def test_repairs_this_hour_are_the_runs_carrying_the_repair_and_deployment_tags() -> None:
    ours, other = PLAN.deployment_id, "other-0a1b2c3d"
    tags = {dep: [REPAIR_TAG, deployment_tag(dep)] for dep in (ours, other)}
    runs = [
        FakeRun(minutes_ago(12), [REPAIR_TAG, deployment_tag(ours), "recipe:x"]),
        FakeRun(minutes_ago(41), [REPAIR_TAG, deployment_tag(ours)]),
        FakeRun(minutes_ago(70), [REPAIR_TAG, deployment_tag(ours)]),  # over an hour ago
        FakeRun(None, [REPAIR_TAG, deployment_tag(ours)]),  # not started
        FakeRun(minutes_ago(5), [REPAIR_TAG, deployment_tag(other)]),
    ]
    found = repairs_by_deployment(runs, tags, NOW - timedelta(hours=1))
    assert found == {ours: (minutes_ago(12), minutes_ago(41)), other: (minutes_ago(5),)}
    assert History("", None, None, found[ours]).repairs_text(NOW) == "2: 12 min ago, 41 min ago"
    assert History("", None, None, ()).repairs_text(NOW) == "none"


def record(written_minutes_ago: float, **probes: LastProbe) -> SentinelRecord:
    return SentinelRecord(minutes_ago(written_minutes_ago), dict(probes))


def test_the_last_probe_reads_from_the_sentinel_record_or_says_why_there_is_none() -> None:
    dep = PLAN.deployment_id
    ok = LastProbe(NOW - timedelta(seconds=14), "ok", "healthy")
    failed = LastProbe(NOW - timedelta(seconds=4), "failed", "suspect", "dgx2", "worker_died", "x")
    assert Sentinel(None, SCHEDULE_OFF).probe_text(dep, NOW) == f"no probe yet: {SCHEDULE_OFF}"
    fresh = Sentinel(record(0.2, **{dep: ok}))
    assert fresh.probe_text(dep, NOW) == "ok, 14 s ago"
    assert fresh.probe_text("new-0a1b2c3d", NOW).startswith("not probed yet: the sentinel picks")
    assert Sentinel(record(0.1, **{dep: failed})).probe_text(dep, NOW) == (
        "failed (suspect): worker_died on dgx2: x, 4 s ago"
    )
    stale_probe = LastProbe(minutes_ago(25), "ok", "healthy")
    stale = Sentinel(record(25, **{dep: stale_probe}), SCHEDULE_OFF)
    assert stale.probe_text(dep, NOW) == f"ok, 25 min ago; none since, {SCHEDULE_OFF}"
    assert stale.probe_text("new-0a1b2c3d", NOW) == f"no probe yet: {SCHEDULE_OFF}"


def test_the_sentinel_record_reads_back_what_was_written_and_nothing_else() -> None:
    written = record(0, a=LastProbe(NOW, "ok", "healthy"), b=LastProbe(NOW, "failed", "suspect"))
    assert SentinelRecord.from_json(json.loads(json.dumps(written.as_json()))) == written
    assert "cause" not in written.as_json()["deployments"]["a"]
    for value in (None, "text", {"written": "yesterday"}, {"written": NOW.isoformat()}):
        assert SentinelRecord.from_json(value) is None


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def wall(self) -> datetime:
        return NOW + timedelta(seconds=self.t)


OK = ProbeResult(Outcome.OK)
FAILED = ProbeResult(Outcome.FAILED, "dgx2", "worker_died", "dgx2 exited (137) " + "x" * 500)


def test_the_sentinel_writes_its_record_every_30_s_and_on_a_transition_only() -> None:
    written: list[dict[str, Any]] = []
    clock = Clock()
    ledger = ProbeLedger(written.append, clock=clock, wall=clock.wall)
    dep, other = "a-0a1b2c3d", "b-0a1b2c3d"

    def probe(at: float, dep: str, result: ProbeResult, before: str, after: str) -> bool:
        clock.t = at
        queued = ledger.probed(dep, result, before, after)
        ledger._writer.submit(lambda: None).result()  # the write, if any, is done
        return queued

    assert probe(0, dep, OK, "healthy", "healthy")  # first watched: at once
    assert not probe(3, dep, OK, "healthy", "healthy")
    assert probe(4, other, OK, "healthy", "healthy")  # another deployment first watched
    # A failed probe (suspect) waits for the periodic write; the verdict does not.
    assert not probe(6, dep, FAILED, "healthy", "suspect")
    assert probe(12, dep, FAILED, "suspect", "unhealthy")
    assert not probe(15, dep, OK, "unhealthy", "unhealthy")
    assert probe(18, dep, OK, "unhealthy", "healthy")
    assert not probe(21, dep, OK, "healthy", "healthy")
    assert probe(18 + RECORD_EVERY_S, dep, OK, "healthy", "healthy")
    assert probe(18 + 2 * RECORD_EVERY_S, dep, OK, "healthy", "healthy")
    assert len(written) == 6
    declared = SentinelRecord.from_json(written[2])
    assert declared is not None
    assert declared.probes[dep] == LastProbe(
        NOW + timedelta(seconds=12),
        "failed",
        "unhealthy",
        "dgx2",
        "worker_died",
        FAILED.cause[:CAUSE_CHARS],
    )
    # `other` has not been probed for over a minute: no longer watched, left out.
    last = SentinelRecord.from_json(written[-1])
    assert last is not None
    assert set(last.probes) == {dep}
    # A deployment gone (torn down) is left out at once; watched again, it is written at once.
    assert not probe(80, dep, ProbeResult(Outcome.GONE), "healthy", "healthy")
    assert probe(81, dep, OK, "healthy", "healthy")
    ledger.close()
    assert len(written) == 8


def test_what_a_deployment_leaves_on_a_node_counts_each_inode_once(tmp_path: Path) -> None:
    local = tmp_path / "local" / "engram-rank0.safetensors"
    local.parent.mkdir()
    with local.open("wb") as out:
        out.truncate(64 << 20)  # sparse: its holes take nothing
        out.write(b"x" * 8192)
    Path(f"{local}{MANIFEST_SUFFIX}").write_text("{}")
    plain = tmp_path / "local" / "chat_template.jinja"
    plain.write_text("{{ messages }}" * 1000)
    root = tmp_path / "composed" / PLAN.deployment_id
    snapshot = root / "models--x" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    os.link(local, snapshot / local.name)
    (snapshot / "config.json").symlink_to("/nas/never/followed/config.json")
    key = {"local_files": [{"path": str(plain)}]}  # the key names one, the request the other
    (root / KEY_FILE).write_text(f"{CACHEDIR_SIGNATURE}\n{KEY_LINE_PREFIX}{json.dumps(key)}\n")
    counted = {
        (st.st_dev, st.st_ino): st.st_blocks * 512
        for st in map(os.lstat, [root, *root.rglob("*"), plain, Path(f"{local}{MANIFEST_SUFFIX}")])
    }
    expected = sum(counted.values())
    found = measure(str(root), [str(local)])
    assert found == {"bytes": expected, "composed": True, "files": 2}
    assert found["bytes"] < 1 << 20
    assert measure(str(tmp_path / "absent"), []) == {"bytes": 0, "composed": False, "files": 0}
    # The same from the shipped script, as a node runs it.
    request = {PLAN.deployment_id: {"root": str(root), "local_files": [str(local)]}}
    answer = ask_usage(LocalNode(), "dgx1", request)
    assert answer == {PLAN.deployment_id: NodeBytes(expected, True, 2)}


def test_each_node_is_asked_about_the_composed_dir_and_local_files_its_plan_names() -> None:
    composed = make_plan(
        load_recipe(ROOT / "recipes" / "dsv41-flash-eugr-0913-4x" / "recipe.toml"), CLUSTER
    )
    serving = DeploymentStatus(
        composed.deployment_id, composed.recipe, CONTAINERS, composed, True, "ready"
    )
    orphan = "gone-recipe-0a1b2c3d"
    on_dgx3 = [NodeContainer("dgx3", 0, "c", "running", 0, "2026-01-01T09:30:00Z")]
    requests = usage_requests(
        CLUSTER, [serving, DeploymentStatus(orphan, "gone-recipe", on_dgx3, None, False, "x")]
    )
    assert set(requests) == {"dgx1", "dgx2", "dgx3"}
    node_plan = composed.nodes[1].composed
    assert node_plan is not None
    assert requests["dgx2"] == {
        composed.deployment_id: {"root": node_plan.root, "local_files": node_plan.local_files}
    }
    # An orphan's dir by its id: its key names its local files.
    assert requests["dgx3"] == {
        orphan: {"root": f"{CLUSTER.node_paths.composed_root}/{orphan}", "local_files": []}
    }


def test_the_status_table_shows_every_column_wrapped_to_the_terminal() -> None:
    history = History("passed, 3 min ago", fault_at(200), None, (minutes_ago(12),))
    sentinel = Sentinel(record(0.2, **{PLAN.deployment_id: LastProbe(NOW, "ok", "healthy")}))
    usage = {
        "dgx1": NodeBytes(3 << 30, True, 1),
        "dgx2": NodeBytes(None, unknown="node dgx2: refused"),
    }
    row = deployment_row(SERVING, history, sentinel, usage, NOW)
    assert list(row) == list(COLUMNS)
    assert all(row.values())  # never blank
    assert row["bytes on each node"] == "dgx1 3.0 GiB, dgx2 unknown (node dgx2: refused)"
    assert row["repairs this hour"] == "1: 12 min ago"
    assert row["last fault"].startswith("worker_died on dgx2, 3 h 20 min ago")
    report = StatusReport("dgx-spark-4", [SERVING], [row])
    lines = report.text(120).splitlines()
    assert max(map(len, lines)) <= 120
    assert lines[0].split()[:2] == ["deployment", "nodes"]
    assert "dgx1 3.0 GiB, dgx2 unknown (node dgx2: refused)" in report.text(400)
    markdown = report.markdown()
    assert "| deployment | nodes | health | healthy since |" in markdown
    assert f"| {PLAN.deployment_id} | dgx1 | 0 | c0 | running |" in markdown
    assert StatusReport("lab", [], []).text(80) == "nothing of ours runs on cluster lab"


def test_a_text_table_wraps_its_widest_columns_and_keeps_narrow_ones_whole() -> None:
    lines = text_table(("a", "wide"), [["short", "word " * 40]], 60)
    assert max(map(len, lines)) <= 60
    assert lines[2].startswith("short  word")
    assert len(lines) > 3
    assert text_table(("a", "b"), [["1", "2"]], 60) == ["a  b", "-  -", "1  2"]


@flow(name="status-test-repair")
def a_repair() -> None:
    """Stands for a repair run: a flow run carrying the repair tags."""


def test_the_history_and_the_sentinel_record_read_back_from_a_prefect_server(
    prefect_harness: Path, tmp_path: Path
) -> None:
    """Against the test harness's server: health events, a repair run and the sentinel's record
    written as the watchdog, the repair and the sentinel write them, read as status reads them."""
    from prefect.client.orchestration import get_client
    from prefect.events.worker import EventsWorker

    dep = f"status-test-{tmp_path.name}"
    plan = PLAN.model_copy(update={"deployment_id": dep})
    now = datetime.now(UTC)
    for minutes, health in [
        (30, Health(False, "dgx1", "head_exited", "an older fault")),
        (10, Health(False, "dgx2", "worker_died", "dgx2 exited (137)")),
        (5, Health.ok(plan)),
        (1, Health.ok(plan)),
    ]:
        emit_event(
            **health_event(plan, "dgx-spark-4", health), occurred=now - timedelta(minutes=minutes)
        )
    EventsWorker.drain_all()
    with tags(REPAIR_TAG, deployment_tag(dep)):
        a_repair()
    cluster = f"status-test-{tmp_path.name}"
    failed = LastProbe(now, "failed", "suspect", "dgx2", "worker_died", "dgx2 exited (137)")
    write_record(cluster, SentinelRecord(now, {dep: LastProbe(now, "ok", "healthy")}).as_json())
    sent: list[str] = []
    send = httpx.Client.send

    def counted(client: httpx.Client, request: httpx.Request, **options: Any) -> httpx.Response:
        sent.append(f"{request.method} {request.url.path}")
        return send(client, request, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(httpx.Client, "send", counted)
        write_record(cluster, SentinelRecord(now, {dep: failed}).as_json())  # the update
    # Once created, a write is one request to the server (the sentinel's cost per 30 s), sent
    # again only when the server answers busy (its SQLite meeting another writer).
    assert set(sent) == {f"PATCH /api/variables/name/{sentinel_variable(cluster)}"}
    with get_client(sync_client=True) as client:
        deadline = time.monotonic() + 60
        while (found := read(client, dep, now)).recovered is None:
            assert time.monotonic() < deadline, f"the events are not read back: {found}"
            time.sleep(0.5)
        fault = Fault(now - timedelta(minutes=10), "dgx2", "worker_died", "dgx2 exited (137)")
        assert found.fault == fault
        assert found.recovered == now - timedelta(minutes=5)
        assert len(found.repairs) == 1
        sentinel = read_sentinel(client, cluster, now)
        assert sentinel.probe_text(dep, now).startswith("failed (suspect): worker_died on dgx2")
        absent = read_sentinel(client, f"{cluster}-none", now)
        assert absent.probe_text(dep, now) == (
            f"no probe yet: no sentinel/{cluster}-none deployment is registered"
            " (prefect deploy --all)"
        )


def read(client: SyncPrefectClient, dep: str, now: datetime) -> History:
    [history] = read_history(
        client,
        [dep],
        now,
        repair_tags={dep: [REPAIR_TAG, deployment_tag(dep)]},
        repair_window=timedelta(hours=1),
    ).values()
    return history


def test_a_record_write_that_meets_a_busy_server_is_sent_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SQLite's 503 (a write that met another writer; seen in CI) and a 429 delay the record's
    write instead of losing it until the next one, 30 s later; other answers are not retried."""
    answers = [503, 429, 204, 500]
    sent: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/csrf-token"):  # as a server without CSRF protection
            return httpx.Response(422, text="CSRF protection is disabled.", request=request)
        sent.append(f"{request.method} {request.url.path}")
        return httpx.Response(answers.pop(0), request=request)

    client = SyncPrefectClient(
        "http://prefect.invalid/api", httpx_settings={"transport": httpx.MockTransport(answer)}
    )
    client._client.__class__ = SingleAttemptHttpxClient

    @contextmanager
    def the_client() -> Iterator[SyncPrefectClient]:
        yield client

    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    monkeypatch.setattr(tasks.sentinel, "single_attempt_client", the_client)
    write_record("busy", {"at": "now"})
    assert sent == ["PATCH /api/variables/name/sentinel-busy"] * 3
    assert len(waits) == 2
    with pytest.raises(httpx.HTTPStatusError):
        write_record("busy", {"at": "later"})
    assert len(sent) == 4
    assert len(waits) == 2
