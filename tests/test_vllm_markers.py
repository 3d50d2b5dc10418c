"""The distributed layer's fatal lines: each named with its hint, none on a healthy boot.

Each line is built from its upstream format string (the source file is in the marker's comment
in sparkdeploy/vllm/markers.py), with the prefix of the vLLM process that prints it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sparkdeploy.steps.readiness_gate.watch import BootWatch
from sparkdeploy.vllm.log_lines import LogLine, classify_log
from sparkdeploy.vllm.markers import DEFAULT_FAILURE_MARKERS, FAILURE_HINTS

LOGS = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu"
WORKER = "(Worker_TP1 pid=412) ERROR 12-03 12:41:20 [multiproc_executor.py:1063]"
CORE = "(EngineCore pid=301) ERROR 12-03 12:41:20 [multiproc_executor.py:316]"
API = "(APIServer pid=1) ERROR 12-03 12:41:21 [utils.py:597]"

DISTRIBUTED_LINES = {
    # torch's C10D_NCCL_CHECK, raised as DistBackendError: named by what failed
    "torch_nccl": (
        "nccl_error",
        f"{WORKER} torch.distributed.DistBackendError: NCCL error in: "
        "/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled system error "
        "(run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3",
    ),
    "vllm_pynccl": (
        "nccl_error",
        f"{WORKER} RuntimeError: NCCL error: remote process exited or there was a network error",
    ),
    "dist_backend": (
        "dist_backend_error",
        f"{WORKER} torch.distributed.DistBackendError: [Rank 1] Process group watchdog thread "
        "terminated with exception: [Rank 1] Watchdog caught collective operation timeout",
    ),
    "store_wait": (
        "dist_store_error",
        f"{WORKER} torch.distributed.DistStoreError: wait timeout after 300000ms, keys: "
        "/default_pg//cpu//0",
    ),
    "store_barrier": (
        "dist_store_error",
        f"{WORKER} torch.distributed.DistStoreError: Timed out initializing process group in "
        "store based barrier on rank 1, for key: store_based_barrier_key:1 (world_size=2, "
        "num_workers_joined=1, timeout=0:30:00 error=Socket Timeout)",
    ),
    # TCPStore's waitForWorkers is a DistStoreError that says more: the earlier marker wins
    "store_clients": (
        "workers_never_joined",
        f"{WORKER} torch.distributed.DistStoreError: Timed out after 1801 seconds waiting for "
        "clients. 1/2 clients joined.",
    ),
    "worker_proc": (
        "worker_proc_died",
        f"{CORE} Worker proc Worker_TP1 died unexpectedly (exit code: -9), shutting down executor.",
    ),
    "rpc": (
        "rpc_timed_out",
        f"{WORKER} TimeoutError: RPC call to execute_model timed out.",
    ),
    "rpc_callable": (
        "rpc_timed_out",
        f"{CORE} TimeoutError: RPC call to <function sample_tokens at 0x7f3a> timed out.",
    ),
    "engine_core_proc": (
        "engine_core_proc_died",
        f"{API} RuntimeError: Engine core process EngineCore_DP0 died unexpectedly.",
    ),
    "engine_core_proc_logged": (
        "engine_core_proc_died",
        f"{API} Exception occurred while running API servers: Engine core process EngineCore_DP0 "
        "died unexpectedly.",
    ),
}
NEW_MARKERS = {
    "nccl_error",
    "dist_backend_error",
    "dist_store_error",
    "worker_proc_died",
    "rpc_timed_out",
    "engine_core_proc_died",
}


@pytest.mark.parametrize("case", sorted(DISTRIBUTED_LINES))
def test_distributed_failure_is_named_with_its_hint(case: str) -> None:
    kind, line = DISTRIBUTED_LINES[case]
    watch = BootWatch(head="node1", workers=["node2"], started_at=0.0)
    failure = watch.observe(LogLine("node2", line, 1.0))
    assert failure is not None
    assert (failure.node, failure.kind) == ("node2", kind)
    assert failure.excerpt[-1] == line
    assert f"fix: {FAILURE_HINTS[kind]}" in str(failure.to_error(1.0))


def test_every_new_marker_has_a_hint_and_a_line() -> None:
    names = {marker.name for marker in DEFAULT_FAILURE_MARKERS}
    assert not NEW_MARKERS - names
    assert not NEW_MARKERS - set(FAILURE_HINTS)
    assert not NEW_MARKERS - {kind for kind, _ in DISTRIBUTED_LINES.values()}


def test_quoted_source_lines_of_a_traceback_are_no_failure() -> None:
    # Python 3.11 tracebacks quote the raising line; only the exception's own line is fatal.
    lines = [
        f'{WORKER}     raise RuntimeError(f"NCCL error: {{error_str}}")',
        f'{WORKER}     raise TimeoutError(f"RPC call to {{method}} timed out.") from e',
        f"{WORKER}     raise DistStoreError(  # noqa: B904",
    ]
    assert classify_log(lines, node="node2") is None


def test_worker_proc_died_quotes_the_workers_error_above_it() -> None:
    lines = [
        f"{WORKER} Traceback (most recent call last):",
        f"{WORKER} ValueError: head size 80 is not supported on CPU",
        DISTRIBUTED_LINES["worker_proc"][1],
    ]
    failure = classify_log(lines, node="node1")
    assert failure is not None
    assert failure.kind == "worker_proc_died"
    assert "died of ValueError: head size 80 is not supported on CPU" in failure.cause


@pytest.mark.parametrize("log", ["serve.log", "mn3-head.log", "mn3-worker.log"])
def test_no_new_marker_matches_a_healthy_boot(log: str) -> None:
    lines = (LOGS / log).read_text(encoding="utf-8").splitlines()
    ready = next(
        (i for i, line in enumerate(lines) if "Application startup complete." in line),
        len(lines) - 1,
    )
    patterns = [
        (m.name, re.compile(m.pattern)) for m in DEFAULT_FAILURE_MARKERS if m.name in NEW_MARKERS
    ]
    alarms = [
        (name, line)
        for line in lines[: ready + 1]
        for name, pattern in patterns
        if pattern.search(line)
    ]
    assert alarms == []
