"""Helpers of the flow tests on the lab: whether the lab can run here (and a lab brought up for a
block), the environment and the worker of a subprocess on the session's Prefect server, the lab
recipes and variants of them written for one test, the check that a deployment left nothing
behind (no container of ours, no node held), a deploy run compared step by step with the preview
made before it, and the fault matrix's table of measured detection times, which the session
writes to the end of the pytest output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from uuid import UUID

import pytest

from lab.cluster import REQUIRED_TOOLS, Lab
from lab.prefect_local import (
    PROJECT_ROOT,
    deploy_run,
    register_deployments,
    start_worker,
    stop_worker,
)
from lab.testing.engine_chat import answer_text, chat
from sparkdeploy.remote import ssh
from sparkdeploy.remote.docker_cli import list_containers
from sparkdeploy.remote.ssh import cached_connection
from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.steps.hold_nodes import holders
from sparkdeploy.steps.status import cluster_status

if TYPE_CHECKING:
    from prefect.client.schemas.objects import Artifact, Log, State, TaskRun

    from sparkdeploy.spec.plan import Plan
    from sparkdeploy.steps.preview import Preview


def lab_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, mounts, dockerd); run the suite as root"
    missing = [tool for tool in (*REQUIRED_TOOLS, "docker-registry") if shutil.which(tool) is None]
    if missing:
        return f"the lab needs {', '.join(missing)}: run scripts/setup"
    probe = subprocess.run(
        ["unshare", "--net", "--mount", "--uts", "true"], capture_output=True, timeout=10
    )
    if probe.returncode != 0:
        return f"namespaces are unavailable here: {probe.stderr.decode(errors='replace').strip()}"
    return None


@contextmanager
def lab_brought_up(name: str, nodes: int, **options: Any) -> Iterator[Lab]:
    """Lab(name, nodes, **options) up for the block, down after it, checked to leave nothing
    behind; where the lab cannot run here, the test is skipped with the reason."""
    reason = lab_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    lab = Lab(name, nodes, **options)
    lab.up()
    try:
        yield lab
    finally:
        ssh.close_cached()
        lab.down()
    remains = lab.remains()
    assert not remains, f"lab down left {remains}"


LAB_SINGLE_RECIPE = PROJECT_ROOT / "recipes" / "lab-single" / "recipe.toml"
LAB_DSV41_RECIPE = PROJECT_ROOT / "recipes" / "lab-dsv41-3x" / "recipe.toml"


# lab/prefect.yaml's trigger on deploy/deploy (the automation has the trigger's name).
REPAIR_AUTOMATION = "sparkdeploy: repair an unhealthy deployment"


def register_lab_deployments(env: Mapping[str, str], names: Sequence[str] = ()) -> None:
    """The lab's deployments on the session's shared Prefect server, with their repair
    automation paused: an unhealthy event one test makes (a watchdog finding a killed worker)
    must not leave a repair run waiting for the next test's worker to pick it up.
    tests/test_keepup_lab.py tests the repair on a server of its own."""
    from prefect.client.orchestration import get_client

    register_deployments(env, names)
    with get_client(sync_client=True) as client:
        for automation in client.read_automations_by_name(REPAIR_AUTOMATION):
            client.pause_automation(automation.id)


def harness_env(prefect_harness: Path) -> dict[str, str]:
    """The environment of a subprocess (the prefect CLI, a worker) on the session's shared
    Prefect server: this process's, with the server's API URL and PREFECT_HOME."""
    from prefect.settings import PREFECT_API_URL

    return {
        **os.environ,
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "PREFECT_HOME": str(prefect_harness),
    }


@contextmanager
def lab_worker(
    env: Mapping[str, str], log: Path, *, tail_chars: int = 5000
) -> Iterator[subprocess.Popen[bytes]]:
    """The lab's deployments registered (register_lab_deployments) and a process worker on
    their pool, logging to `log`, for the block; stopped after it. Where the block fails, the
    log's last `tail_chars` are printed."""
    register_lab_deployments(env)
    worker = start_worker(env, log)
    try:
        yield worker
    except BaseException:
        print(log.read_text()[-tail_chars:])
        raise
    finally:
        stop_worker(worker)


@dataclass
class Worker:
    """A Prefect process worker on the pool of prefect.yaml's deployments, started anew when
    a test killed it."""

    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None

    def running(self) -> subprocess.Popen[bytes]:
        if self.process is None or self.process.poll() is not None:
            self.process = start_worker(self.env, self.log)
        return self.process

    def submit(self, recipe: str, cluster: str) -> str:
        """`prefect deployment run deploy/deploy`; the flow run's id."""
        self.running()
        return deploy_run(self.env, recipe, cluster)


def wait_for_state(flow_run_id: str, timeout_s: float = 120.0) -> State:
    """The flow run's state once it is final."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deadline = time.monotonic() + timeout_s
        while (
            state := client.read_flow_run(UUID(flow_run_id)).state
        ) is None or not state.is_final():
            assert time.monotonic() < deadline, f"flow run {flow_run_id} still {state}"
            time.sleep(0.5)
    return state


FLOW_END = "Finished in state "


def final_run_logs(flow_run_id: str | UUID, timeout_s: float = 60.0) -> list[str]:
    """Every log line of a flow run that a worker ran, once its last one is on the server.

    The flow run's process sends its logs in batches every few seconds and the last of them as
    it exits, after the run's state is final: a read right after the state turned final, or
    after the worker (and its flow-run process) was stopped, can miss lines logged long before
    (CI once missed the prefetch's "hashed" line of a brownfield deploy). The engine logs
    "Finished in state ..." after it set that state and a process sends its batches in order,
    so once the flow's own (not a task run's) is there, every line before it is too. Read it
    before the worker stops."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    of_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(str(flow_run_id))]))
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            found: list[Log] = []
            while page := client.read_logs(of_run, limit=200, offset=len(found)):
                found += page
            lines = [log.message for log in found]
            if any(log.task_run_id is None and log.message.startswith(FLOW_END) for log in found):
                return lines
            assert time.monotonic() < deadline, (
                f"flow run {flow_run_id}: no {FLOW_END!r} line of its own after {timeout_s:.0f} s:"
                + "\n".join(["", *lines[-40:]])
            )
            time.sleep(0.5)


def ask(endpoint: str, model: str, prompt: str, *, timeout_s: float = 30, **body: object) -> str:
    """The engine's reply to one user message (`body`: more of the request, such as
    temperature); the request must succeed."""
    reply = chat(endpoint, model, prompt, timeout_s=timeout_s, **body)
    assert reply.status == 200, reply.body
    return answer_text(reply)


def nothing_runs(cluster: str) -> None:
    inventory = load_cluster(Path(cluster))
    assert cluster_status(inventory) == []
    assert set(holders(inventory.name, [n.name for n in inventory.nodes]).values()) == {None}


def with_env(**env: str) -> tuple[str, str]:
    """A recipe_variant replacement that adds `env` to the recipe's [env] table."""
    lines = "".join(f"{name} = {json.dumps(value)}\n" for name, value in env.items())
    return "[env]\n", f"[env]\n{lines}"


def recipe_variant(tmp_path: Path, name: str, source: Path, *replacements: tuple[str, str]) -> str:
    """`source` with lines replaced, as <tmp>/<name>/recipe.toml; returns the recipe dir."""
    text = source.read_text()
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / name / "recipe.toml"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return str(path.parent)


# How long the server may take to write the task runs' states of a run that has ended.
TASK_STATES_SETTLE_S = 60.0


def settled_task_runs(
    flow_run_id: str | UUID, timeout_s: float = TASK_STATES_SETTLE_S
) -> list[TaskRun]:
    """The task runs of an ended flow run once the server has written their last states.

    Prefect 3 sends task-run states as events that the server writes a little later, so a read
    right after the flow's end can miss a task run or find it still Running (CI once failed on
    a readiness gate's Failed attempt that was not there yet). Every test that reads task runs
    reads them through this: it waits until none is still Running or Scheduled (a task run
    whose upstream failed stays Pending, NotReady, for good) and two reads agree."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    of_run = FlowRunFilter(id=FlowRunFilterId(any_=[UUID(str(flow_run_id))]))
    deadline = time.monotonic() + timeout_s
    seen: list[tuple[UUID, str | None]] | None = None
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=of_run)
            now = sorted((run.id, run.state.type.value if run.state else None) for run in runs)
            final = all(run.state is not None and _settled(run.state) for run in runs)
            if final and now == seen:
                return runs
            if time.monotonic() >= deadline:
                unsettled = [run.name for run in runs if not (run.state and _settled(run.state))]
                raise AssertionError(
                    f"the task runs of flow run {flow_run_id} did not settle within"
                    f" {timeout_s:.0f} s; not final: {unsettled}"
                )
            seen = now
            time.sleep(1.0)


def _settled(state: State) -> bool:
    return bool(state.is_final() or state.is_pending())


def task_history(flow_run_id: str, *, settled: bool = False) -> list[str]:
    """`<task run name>: <state name>` for each task run of a flow run, in start order: as the
    server has them now (to follow a running flow), or, for a flow run that has ended, once
    they have settled (settled_task_runs)."""
    if settled:
        runs = settled_task_runs(flow_run_id)
    else:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(flow_run_id)]))
            )
    ordered = sorted(
        runs, key=lambda run: (run.start_time or run.expected_start_time or 0, run.name)
    )
    return [f"{run.name}: {run.state.name if run.state else '?'}" for run in ordered]


def flow_process(worker_pid: int, flow_run_id: str) -> int | None:
    """The PID of the process running `flow_run_id` under a worker (its environment names the
    run), or None while there is none."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    pending = list(children.get(worker_pid, []))
    while pending:
        pid = pending.pop()
        pending += children.get(pid, [])
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (
            f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode() in environ
            and b"prefect.engine" in cmdline
        ):
            return pid
    return None


def answers_the_canary(endpoint: str) -> bool:
    """The lab's tiny-chat answers 127*43 right (with the short reasoning the lab recipes' smoke
    tests ask for: glm45's default thinking would use up the reply)."""
    reply = chat(
        endpoint,
        "tiny-chat",
        "What is 127*43?",
        timeout_s=30,
        chat_template_kwargs={"reasoning_effort": "low"},
    )
    return reply.status == 200 and "5461" in answer_text(reply)


# A preview's words for what the image step then reports (sparkdeploy.steps.image.NodeImage).
IMAGE_DONE = {"none": "present", "pull": "pulled", "build": "built", "ship": "distributed"}
# ...and for what stage-engram then reports (sparkdeploy.node.engram_copy.StagingResult).
ENGRAM_DONE = {"none": "skipped", "adopt": "adopted", "copy": "copied", "resume": "resumed"}


def run_artifacts(flow_run_id: str | UUID, **key: Any) -> list[Artifact]:
    """The artifacts that flow run made whose key matches `key` (ArtifactFilterKey's fields:
    any_=[KEY], like_=PREFIX)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(**key),
                flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(str(flow_run_id))]),
            )
        )


def artifact_rows(flow_run_id: str | UUID, key: str) -> list[dict[str, object]]:
    """The rows of the table artifact `key` that flow run made ([] when it made none)."""
    found = run_artifacts(flow_run_id, any_=[key])
    if not found:
        return []
    data = found[0].data
    rows = json.loads(data) if isinstance(data, str) else data
    assert isinstance(rows, list), rows
    return rows


def compare_artifact(flow_run_id: str | UUID | None) -> str:
    """The markdown of the artifact a compare run wrote (its key `compare-...`)."""
    assert flow_run_id is not None, "the compare's state names no flow run"
    [artifact] = run_artifacts(flow_run_id, like_="compare-")
    return str(artifact.data)


def our_containers(plan: Plan) -> dict[str, str]:
    """Container name -> id of our containers (any deployment's) on the plan's nodes."""
    found = {}
    for node, target in plan_targets(plan).items():
        for container in list_containers(cached_connection(target), node, "sparkdeploy.deployment"):
            found[container.name] = container.id
    return found


def deploy_matches_preview(
    found: Preview, plan: Plan, flow_run_id: str | UUID, before: Mapping[str, str]
) -> None:
    """What the deploy run `flow_run_id` of `plan` did, compared step by step with what the
    preview `found` made before it said: the bytes each repo fetched, each node's image and
    Engram copies, the nodes it holds, and the containers it replaced (`before`: our
    containers on its nodes before it, our_containers)."""
    fetched: dict[str, int] = {}
    for file in artifact_rows(flow_run_id, "prefetch-files"):
        repo = str(file["repo"])
        fetched[repo] = fetched.get(repo, 0) + (
            int(str(file["bytes"])) if file["status"] == "fetched" else 0
        )
    for row in found.of_step("prefetch"):
        repo = row.subject.split("@", 1)[0]
        said = row.bytes if row.action == "download" else 0
        assert fetched[repo] == said, (row, fetched)

    image = {
        str(r["node"]): r["action"]
        for r in artifact_rows(flow_run_id, f"image-{plan.deployment_id}")
    }
    assert image == {row.node: IMAGE_DONE[row.action] for row in found.of_step("image")}

    staged = artifact_rows(flow_run_id, f"stage-engram-{plan.deployment_id}")
    assert {(str(r["node"]), str(r["file"])): r["status"] for r in staged} == {
        (row.node, row.subject): ENGRAM_DONE[row.action] for row in found.of_step("stage-engram")
    }

    held = holders(plan.cluster, [node.node for node in plan.nodes])
    for lock in found.of_step("hold-nodes"):
        assert lock.action in ("take", "take over"), lock
        holder = held[lock.node]
        assert holder is not None
        assert holder.deployment_id == plan.deployment_id
        assert holder.flow_run_id == str(flow_run_id)

    after = our_containers(plan)
    removed = {row.subject for row in found.of_step("boot") if row.action == "remove"}
    assert removed == set(before)  # the preview named every container boot replaced
    for name in removed:
        assert after.get(name) not in (None, before[name]), name  # started anew
    assert set(after) == {node.container.name for node in plan.nodes}


@dataclass
class Measured:
    fault: str
    detected_by: str
    seconds: float | None  # None: nothing to detect (the pipeline carries on by itself)
    bound_s: float
    outcome: str
    field_note: str = ""

    @property
    def seconds_text(self) -> str:
        return "-" if self.seconds is None else f"{self.seconds:.1f} s"


@dataclass
class Matrix:
    """The fault matrix's measured detection times (tests/test_fault_matrix_*.py), one row a
    fault; a time beyond its bound fails the test that measured it."""

    rows: list[Measured] = field(default_factory=list)

    def record(
        self,
        fault: str,
        detected_by: str,
        seconds: float | None,
        bound_s: float,
        *,
        outcome: str = "failed",
        field_note: str = "",
    ) -> None:
        assert seconds is None or seconds <= bound_s, (
            f"{fault}: detected {seconds:.1f} s after the evidence, beyond the bound of"
            f" {bound_s:.0f} s"
        )
        self.rows.append(Measured(fault, detected_by, seconds, bound_s, outcome, field_note))

    def table(self) -> str:
        lines = [
            "| fault | detected by | evidence -> named | bound | outcome | in the field |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {row.fault} | {row.detected_by} | {row.seconds_text} | {row.bound_s:.0f} s |"
            f" {row.outcome} | {row.field_note} |"
            for row in self.rows
        ]
        return "\n".join(lines) + "\n"


# (path of the table, the table) once the fault matrix has measured its faults.
FAULT_MATRIX_TABLE = pytest.StashKey[tuple[str, str]]()
