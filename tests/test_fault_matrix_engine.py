"""The fault matrix (tests/fault_matrix.py) in the engine: every fatal line kind of the
readiness gate, a crash on one rank, a real OOM kill, a hang, a worker that never joins, a worker
dead after ready; bad answers the smoke test catches."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
from fault_matrix import (
    BOUND_AT_ONCE_S,
    FAULT_MATRIX_MARKS,
    TWO_NODES,
    Run,
    deploys,
    nothing_left,
    on_node,
    run_flow,
)
from lab_flows import LAB_SINGLE_RECIPE, Matrix, recipe_variant, with_env

from flows.deploy import deploy
from flows.smoke import smoke
from flows.teardown import teardown
from lab.cluster import Lab
from lab.engine.standin_faults import MARKER_NAMED_KINDS
from sparkdeploy.errors import BootFailed, DeploymentDown, SmokeFailed
from sparkdeploy.spec.project import load_plan

pytestmark = FAULT_MATRIX_MARKS

# -- the engine ------------------------------------------------------------------------------


def _docker_time(stamp: str) -> float:
    """docker's RFC 3339 timestamp with nanoseconds, as seconds since the epoch."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{whole}.{(fraction + '000000')[:6]}+00:00").timestamp()


def logged_at(
    cluster: str,
    recipe: str,
    text: str | None,
    node: str | None = None,
    nodes: list[str] | None = None,
) -> float:
    """When a container of the deployment (on `node`, or on any) printed the line holding
    `text`, or its last line (its log, kept on the NAS by the teardown, has docker's
    timestamps)."""
    plan = load_plan(recipe, cluster, nodes)
    kept = Path(plan.runs_dir) / plan.deployment_id
    for plan_node in plan.nodes:
        if node not in (None, plan_node.node):
            continue
        lines = (kept / f"{plan_node.node}.log").read_text().splitlines()
        for line in reversed(lines) if text is None else lines:
            stamp, _, printed = line.partition(" ")
            if text is None or text in printed:
                return _docker_time(stamp)
    raise AssertionError(f"no container printed {text!r}; their logs are in {kept}")


def engine_failure(
    run: Run,
    cluster: str,
    recipe: str,
    *,
    node: str,
    kind: str,
    nodes: list[str] | None = None,
) -> float:
    """The readiness gate named the node and the kind, quoting the line; seconds from that
    line (or from the readiness timeout's end) to the gate's failure."""
    error = run.error
    assert isinstance(error, BootFailed), error
    assert (error.node, error.kind) == (node, kind), error
    attempt = run.named("readiness-gate", node=node, cause=re.escape(kind))
    if kind == "timeout":
        started = next(at for message, at in run.logs if message.startswith("following the"))
        return attempt.at - (started + load_plan(recipe, cluster, nodes).readiness_timeout_s)
    evidence = error.excerpt[-1]
    assert evidence[:80] in str(error), error
    return attempt.at - logged_at(cluster, recipe, evidence[-120:], nodes=nodes)


# Each of the gate's fatal line kinds (sparkdeploy/vllm_markers.py), as the stand-in prints
# it: STANDIN_FAULT, then the kind the gate names.
FATAL_KINDS = {
    "fatal:free_memory": "free_memory_below_utilization",
    "fatal:kv_cache_needed": "kv_cache_too_small_for_max_len",
    "fatal:no_cache_blocks": "no_kv_cache_memory",
    "fatal:cuda_oom": "cuda_out_of_memory",
    "fatal:dist_network": "distributed_connect_timeout",
    "fatal:engine_timeout": "engine_ready_timeout",
    "fatal:engine_core_failed": "engine_core_init_failed",
    "crash": "engine_core_init_failed",
    "exit137": "killed",
    **{f"fatal:{kind}": kind for kind in MARKER_NAMED_KINDS},
}
# The kinds a recipe's own mistake makes the stand-in print: recipe lines replaced, the kind.
RECIPE_KINDS = {
    "unrecognized_arguments": ('"--max-model-len", "4096",', '"--bogus-flag", "1",'),
    # A value the recipe's own checks leave to vLLM (--max-model-len lots is refused at plan).
    "bad_command_line": ('"--max-model-len", "4096",', '"--max-model-len", "4096", "--seed", "x",'),
}
# The kinds only real vLLM prints, and where they are seen.
FATAL_KINDS_OF_THE_REAL_ENGINE = {
    "max_model_len_too_long": "tests/test_real_engine.py::test_a_real_start_up_failure_is_named",
    "model_path_invalid": "tests/test_vllm_logs.py (real vLLM 0.32's log of it, fed to the gate)",
}


def test_the_matrix_has_every_fatal_line_kind_of_the_gate() -> None:
    from sparkdeploy.vllm.markers import DEFAULT_FAILURE_MARKERS

    covered = {
        *FATAL_KINDS.values(),
        *RECIPE_KINDS,
        "model_not_in_offline_cache",
        *FATAL_KINDS_OF_THE_REAL_ENGINE,
    }
    assert {marker.name for marker in DEFAULT_FAILURE_MARKERS} <= covered


@dataclass(frozen=True)
class FatalCase:
    label: str
    recipe: str
    kind: str
    skip: tuple[str, ...] = ("smoke-test",)


def fatal_cases(tmp_path: Path) -> list[FatalCase]:
    """A lab-single variant per fatal line kind the stand-in or a recipe mistake shows."""
    cases = [
        FatalCase(
            f"{kind} ({fault})",
            recipe_variant(
                tmp_path, f"lab-fatal-{index}", LAB_SINGLE_RECIPE, with_env(STANDIN_FAULT=fault)
            ),
            kind,
        )
        for index, (fault, kind) in enumerate(sorted(FATAL_KINDS.items()))
    ]
    cases += [
        FatalCase(
            f"{kind} (recipe)",
            recipe_variant(tmp_path, f"lab-{kind}", LAB_SINGLE_RECIPE, line),
            kind,
        )
        for kind, line in sorted(RECIPE_KINDS.items())
    ]
    missing = ('model = "lab/tiny-chat"', 'model = "lab/nowhere"')
    cases.append(
        FatalCase(
            "model_not_in_offline_cache (not prefetched)",
            recipe_variant(tmp_path, "lab-no-model", LAB_SINGLE_RECIPE, missing),
            "model_not_in_offline_cache",
            # The fit step reads the model's config first and says "run the prefetch step".
            ("prefetch", "fit", "smoke-test"),
        )
    )
    return cases


def test_each_fatal_line_kind_fails_the_boot_naming_node_and_kind(
    cluster: str, lab_cluster: Lab, tmp_path: Path, matrix: Matrix
) -> None:
    """Every kind once, in three lanes at a time (a lane per node, one deploy after another),
    as a deploy of one node each."""
    cases = fatal_cases(tmp_path)
    outcomes: dict[str, float | BaseException] = {}

    def lane(node: str, share: list[FatalCase]) -> None:
        for case in share:
            try:
                run = run_flow(deploy, case.recipe, cluster=cluster, nodes=[node], skip=case.skip)
                assert run.failed, f"{case.label} deployed"
                outcomes[case.label] = engine_failure(
                    run, cluster, case.recipe, node=node, kind=case.kind, nodes=[node]
                )
            except Exception as error:
                outcomes[case.label] = error

    lanes = [
        threading.Thread(target=lane, args=(node, cases[index :: len(lab_cluster.nodes)]))
        for index, node in enumerate(lab_cluster.nodes)
    ]
    for started in lanes:
        started.start()
    for started in lanes:
        started.join()
    failed = {label: error for label, error in outcomes.items() if isinstance(error, Exception)}
    assert not failed, failed
    assert len(outcomes) == len(cases)
    nothing_left(lab_cluster, cluster)
    for case in cases:
        seconds = outcomes[case.label]
        assert isinstance(seconds, float)
        matrix.record(f"fatal line: {case.label}", "readiness-gate", seconds, BOUND_AT_ONCE_S)


def worker_named(run: Run, lab: Lab, cluster: str, recipe: str) -> tuple[str, float]:
    """A two-node boot that failed on its worker, node2, named so; its kind and the seconds
    from the evidence. Nothing may be left of it."""
    assert run.failed
    error = run.error
    assert isinstance(error, BootFailed), error
    assert error.node == "node2", error
    seconds = engine_failure(run, cluster, recipe, node="node2", kind=error.kind)
    nothing_left(lab, cluster)
    return error.kind, seconds


def test_an_engine_crash_on_one_rank_is_named_on_its_node(
    cluster: str, lab_cluster: Lab, tmp_path: Path, matrix: Matrix
) -> None:
    recipe = recipe_variant(
        tmp_path, "lab-two-crash", LAB_SINGLE_RECIPE, *TWO_NODES, with_env(STANDIN_FAULT="crash@1")
    )
    run = run_flow(deploy, recipe, cluster=cluster, skip=["smoke-test"])
    kind, seconds = worker_named(run, lab_cluster, cluster, recipe)
    matrix.record(f"engine crash on one rank ({kind})", "readiness-gate", seconds, BOUND_AT_ONCE_S)


def test_a_real_oom_kill_is_named_from_dockers_state(
    cluster: str, lab_cluster: Lab, tmp_path: Path, matrix: Matrix
) -> None:
    """The kernel enforces a container memory limit (an inventory whose docker.run_options cap
    the memory) on an engine that allocates past it."""
    capped = lab_cluster.inventory_path.with_name("cluster-memory-capped.toml")
    capped.write_text(
        lab_cluster.inventory_path.read_text().replace(
            "run_options = [", 'run_options = ["--memory", "128m", "--memory-swap", "128m", ', 1
        )
    )
    recipe = recipe_variant(
        tmp_path, "lab-oom", LAB_SINGLE_RECIPE, with_env(STANDIN_FAULT="allocate:512")
    )
    run = run_flow(deploy, recipe, cluster=str(capped), skip=["smoke-test"])
    assert run.failed
    error = run.error
    assert isinstance(error, BootFailed), error
    assert (error.node, error.kind) == ("node1", "oom_killed"), error
    assert "State.OOMKilled is true" in error.cause
    attempt = run.named("readiness-gate", node="node1", cause="oom_killed")
    last_line = logged_at(str(capped), recipe, None, "node1")  # just before the kill
    nothing_left(lab_cluster, cluster)
    matrix.record(
        "real OOM kill (cgroup memory limit)",
        "readiness-gate: the container exits 137, docker's State.OOMKilled is true",
        attempt.at - last_line,
        BOUND_AT_ONCE_S,
    )


def test_a_hang_fails_on_the_readiness_timeout(
    cluster: str, lab_cluster: Lab, tmp_path: Path, matrix: Matrix
) -> None:
    recipe = recipe_variant(
        tmp_path,
        "lab-hang",
        LAB_SINGLE_RECIPE,
        with_env(STANDIN_FAULT="hang"),
        ('VLLM_ENGINE_READY_TIMEOUT_S = "60"', 'VLLM_ENGINE_READY_TIMEOUT_S = "5"'),
    )
    run = run_flow(deploy, recipe, cluster=cluster)
    assert run.failed
    seconds = engine_failure(run, cluster, recipe, node="node1", kind="timeout")
    nothing_left(lab_cluster, cluster)
    matrix.record(
        "engine hangs (never ready)",
        "readiness-gate: its timeout, naming the marker it waited for",
        seconds,
        BOUND_AT_ONCE_S,
        field_note="the recipe's VLLM_ENGINE_READY_TIMEOUT_S (5 s here, 600 s by default)",
    )


def test_a_worker_that_never_joins_is_named(
    cluster: str, lab_cluster: Lab, tmp_path: Path, matrix: Matrix
) -> None:
    """node2 cannot reach node1 over the fabric (a route in node2's namespace).
    Real vLLM's case: tests/test_real_engine.py::test_a_worker_that_never_joins_is_named."""
    recipe = recipe_variant(
        tmp_path,
        "lab-two-apart",
        LAB_SINGLE_RECIPE,
        *TWO_NODES,
        with_env(VLLM_RENDEZVOUS_TIMEOUT_S="5"),
    )
    # node1 by way of a gateway that is not there: node2's packets to it go nowhere, as on a
    # fabric whose switch drops them (a blackhole route would refuse at once).
    nowhere = lab_cluster.node_ip("node1").rsplit(".", 1)[0] + ".250"
    route = [f"{lab_cluster.node_ip('node1')}/32", "via", nowhere]
    in_node2 = ["ip", "netns", "exec", lab_cluster.layout.node_netns("node2"), "ip", "route"]
    subprocess.run([*in_node2, "add", *route], check=True, timeout=10)
    try:
        run = run_flow(deploy, recipe, cluster=cluster, skip=["smoke-test"])
    finally:
        subprocess.run([*in_node2, "del", *route], check=True, timeout=10)
    kind, seconds = worker_named(run, lab_cluster, cluster, recipe)
    matrix.record(
        f"a worker never joins ({kind})",
        "readiness-gate: the worker's rendezvous timeout (VLLM_RENDEZVOUS_TIMEOUT_S, 5 s here)",
        seconds,
        BOUND_AT_ONCE_S,
    )


def test_a_worker_dead_after_ready_is_named_by_the_watchdog(
    cluster: str, lab_cluster: Lab, matrix: Matrix
) -> None:
    """The watchdog re-plans what runs from the recipes it knows, so a recipe of the repo.
    Real vLLM's case: tests/test_real_engine.py::test_two_nodes_deploy_through_prefect_and_
    a_killed_worker_is_named."""
    deploys("lab-dsv41-3x", cluster, skip=["smoke-test"])
    worker = load_plan("lab-dsv41-3x", cluster).nodes[1]
    on_node(lab_cluster, "node2", "docker", "kill", worker.container.name)
    killed_at = time.time()
    run = run_flow(smoke, cluster=cluster)
    assert run.failed
    error = run.error
    assert isinstance(error, DeploymentDown), error
    assert error.node == "node2", error
    attempt = run.named("watchdog-health", node="node2", cause=error.kind)
    teardown("lab-dsv41-3x", cluster=cluster)
    nothing_left(lab_cluster, cluster)
    matrix.record(
        f"worker dead after ready ({error.kind})",
        "the smoke watchdog: a smoke check fails, its health step reads the containers and the"
        " head's log",
        attempt.at - killed_at,
        BOUND_AT_ONCE_S,
        field_note="the watchdog runs every 30 minutes",
    )


# -- bad answers: the smoke test -------------------------------------------------------------

# How long the smoke test waits for an answer here (the hung long prompt waits this long).
SMOKE_REQUEST_TIMEOUT_S = 5.0
SMOKE_FAULTS = {
    "token_loop": "no_token_loops",
    "garbled": "no_garbled_text",
    "empty_content": "no_empty_content",
    "bad_after:5": "burst",
    "hang_long_prompt": "long_prompt",
}


@pytest.mark.parametrize(("fault", "check"), sorted(SMOKE_FAULTS.items()))
def test_a_bad_engine_fails_the_smoke_test_naming_the_check_and_is_rolled_back(
    cluster: str, lab_cluster: Lab, tmp_path: Path, matrix: Matrix, fault: str, check: str
) -> None:
    recipe = recipe_variant(
        tmp_path,
        "lab-bad-answers",
        LAB_SINGLE_RECIPE,
        with_env(STANDIN_FAULT=fault),
        ("[smoke]\n", f"[smoke]\nrequest_timeout_s = {SMOKE_REQUEST_TIMEOUT_S}\n"),
    )
    run = run_flow(deploy, recipe, cluster=cluster)
    assert run.failed
    assert isinstance(run.error, SmokeFailed), run.error
    attempt = run.named("smoke-test", node="node1", cause=check)
    failed = re.findall(r"^  (\w+): (.*)$", str(run.error), re.MULTILINE)
    if fault == "bad_after:5":  # the gate's one-token completion was the first good answer
        assert ("burst", "request 2 of 8 (#5 overall") in [(n, e[:26]) for n, e in failed]
    if fault == "hang_long_prompt":
        assert [(name, "no answer within" in evidence) for name, evidence in failed] == [
            ("long_prompt", True)
        ]
    started = next(at for message, at in run.logs if message.startswith("smoke test of"))
    nothing_left(lab_cluster, cluster)
    matrix.record(
        f"bad answers: {fault}",
        f"smoke-test: check {check}",
        attempt.at - started,
        SMOKE_REQUEST_TIMEOUT_S + BOUND_AT_ONCE_S,
        field_note="a hung request counts after the recipe's [smoke] request_timeout_s"
        if fault == "hang_long_prompt"
        else "",
    )


def test_after_the_engine_faults_the_recipe_deploys(cluster: str, lab_cluster: Lab) -> None:
    """The re-run of every engine fault above: each was the recipe's (its STANDIN_FAULT, a
    flag, a route, a memory cap) or the watchdog's killed worker, and each left the nodes
    clean, so one deploy on all three nodes, smoke test included, shows a re-run succeeds."""
    deploys("lab-dsv41-3x", cluster)
    teardown("lab-dsv41-3x", cluster=cluster)
    nothing_left(lab_cluster, cluster)
