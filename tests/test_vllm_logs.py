"""The readiness gate and the engine stand-in against real vLLM 0.32.0 CPU logs.

The logs in tests/fixtures/vllm-0.32-cpu were printed by the real `vllm serve` (see its
README.md). (a) Each is fed through the gate's BootWatch (pure, no I/O): the good boots complete
with the right timeline and figures, each failure gets its named kind. (b) The stand-in's log,
for the same single-node and two-node commands, prints the markers both print in the real
order, from the same processes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import test_engine_standin as standin
from test_engine_standin import Engine, Engines, free_port, node_flags

from sparkdeploy.steps.readiness_gate.watch import BootWatch, ContainerExited
from sparkdeploy.vllm.log_lines import Failure, LogLine, classify_log
from sparkdeploy.vllm.markers import (
    DEFAULT_BOOT_MARKERS,
    DEFAULT_RECORDED_MARKERS,
    HEADLESS_WORKER_JOINED,
    HEADLESS_WORKER_LAUNCHING,
    Marker,
)

# the stand-in's fixtures (a tiny model, its HF cache, engines killed at the end), shared
repo = standin.repo
hf_cache = standin.hf_cache
engines = standin.engines

LOGS = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu"
READY_LINE = "Application startup complete."
HEAD, WORKER = "node1", "node2"
# In the mn* runs both "nodes" were one machine: the worker's address was 127.0.0.1.
NODE_OF_IP = {"127.0.0.1": WORKER}


def lines_of(name: str) -> list[str]:
    return (LOGS / name).read_text(encoding="utf-8").splitlines()


def until(lines: list[str], text: str) -> list[str]:
    """`lines` up to and including the first that contains `text`."""
    index = next(i for i, line in enumerate(lines) if text in line)
    return lines[: index + 1]


def feed(watch: BootWatch, node: str, lines: list[str]) -> Failure | None:
    """Each line at t = its index; the first failure, or None."""
    for index, line in enumerate(lines):
        failure = watch.observe(LogLine(node, line, float(index)))
        if failure is not None:
            return failure
    return None


def entry(watch: BootWatch, node: str, marker: str) -> tuple[float, str]:
    found = [e for e in watch.timeline if e.node == node and e.marker == marker]
    assert len(found) == 1, (node, marker, watch.timeline)
    return found[0].seconds, found[0].line


# -- (a) the gate on the real logs ------------------------------------------------------------


def test_single_node_boot_completes_with_its_figures() -> None:
    watch = BootWatch(head=HEAD, workers=[], started_at=0.0)
    assert feed(watch, HEAD, until(lines_of("serve.log"), READY_LINE)) is None
    assert watch.complete
    assert watch.head_figures == {
        "weights_load_s": 0.01,
        "kv_cache_tokens": 524288.0,
        "max_concurrency_request_tokens": 1024.0,
        "max_concurrency": 512.0,
        "init_engine_s": 2.51,
    }
    markers = [e.marker for e in watch.timeline]
    assert markers == [
        "weights_loaded",
        "kv_cache_size",
        "max_concurrency",
        "engine_initialized",
        "api_server_starting",
        "uvicorn_started",
        "application_startup",
        "application_ready",
    ]
    # the GPU-only lines are not printed on CPU, and not awaited
    assert "model_loaded" not in markers
    assert "kv_cache_memory" not in markers


@pytest.mark.parametrize(
    ("run", "kv_tokens", "init_s"),
    [
        ("mn", 1048576.0, 5.69),
        ("mn2", 1048576.0, None),
        ("mn3", 1048576.0, 0.87),
        ("mn4", None, None),
    ],
)
def test_two_node_boot_completes_when_the_worker_has_joined(
    run: str, kv_tokens: float | None, init_s: float | None
) -> None:
    watch = BootWatch(head=HEAD, workers=[WORKER], started_at=0.0, node_of_ip=NODE_OF_IP)
    worker = lines_of(f"{run}-worker.log")
    launching = until(worker, "headless multiproc executor")
    assert feed(watch, WORKER, launching) is None
    # Launching is printed at start-up, before the worker joined: recorded, not enough.
    assert watch.unjoined_workers() == [WORKER]
    assert entry(watch, WORKER, "headless_worker_launching")[1].startswith("Launching vLLM")
    joined = until(worker, "in world size 2 is assigned as")
    assert feed(watch, WORKER, joined) is None
    assert watch.unjoined_workers() == []
    seconds, line = entry(watch, WORKER, "headless_worker_joined")
    assert line.startswith("rank 1 in world size 2 is assigned as DP rank 0, PP rank 0")
    assert seconds == len(joined) - 1
    assert entry(watch, WORKER, "headless_worker_launching")[0] < seconds

    assert not watch.complete  # the head has printed nothing yet
    assert feed(watch, HEAD, until(lines_of(f"{run}-head.log"), READY_LINE)) is None
    assert watch.complete
    figures = watch.head_figures
    assert figures["weights_load_s"] in (0.02, 0.03)
    assert figures["kv_cache_tokens"] == (kv_tokens or figures["kv_cache_tokens"])
    assert figures["kv_cache_tokens"] > 0
    assert figures["init_engine_s"] > 0
    if init_s is not None:
        assert figures["init_engine_s"] == init_s


def test_a_worker_that_never_joined_is_still_awaited_after_launching() -> None:
    watch = BootWatch(head=HEAD, workers=[WORKER], started_at=0.0)
    assert feed(watch, HEAD, until(lines_of("mn2-head.log"), "backend=gloo")) is None
    assert feed(watch, WORKER, until(lines_of("mn2-worker.log"), "backend=gloo")) is None
    assert watch.unjoined_workers() == [WORKER]
    awaited = watch.awaited()
    assert awaited is not None
    assert awaited[0] == HEAD


@pytest.mark.parametrize(
    ("log", "kind", "evidence"),
    [
        (
            "fail-unknown-flag.log",
            "unrecognized_arguments",
            "unrecognized arguments: --bogus-flag 1",
        ),
        (
            "fail-maxlen-too-big.log",
            "max_model_len_too_long",
            "User-specified max_model_len (4096) is greater than the derived max_model_len",
        ),
        (
            "fail-missing-hub-model-offline.log",
            "model_not_in_offline_cache",
            "huggingface_hub.errors.LocalEntryNotFoundError: Cannot find an appropriate cached",
        ),
        (
            "fail-missing-model.log",
            "model_path_invalid",
            "HFValidationError: Repo id must be in the form",
        ),
    ],
)
def test_each_start_up_failure_is_named_with_its_evidence(
    log: str, kind: str, evidence: str
) -> None:
    watch = BootWatch(head=HEAD, workers=[], started_at=0.0)
    failure = feed(watch, HEAD, lines_of(log))
    assert failure is not None
    assert (failure.node, failure.kind) == (HEAD, kind)
    assert any(evidence in line for line in failure.excerpt), failure.excerpt
    assert evidence in failure.cause
    error = failure.to_error(1.0)
    assert "fix: " in str(error)
    assert "read the quoted lines" not in str(error)
    classified = classify_log(lines_of(log), node=HEAD)
    assert classified is not None
    assert (classified.kind, classified.cause) == (kind, failure.cause)


def test_the_unknown_flag_quotes_the_usage_line() -> None:
    failure = classify_log(lines_of("fail-unknown-flag.log"), node=HEAD)
    assert failure is not None
    assert failure.excerpt[1] == "usage: vllm [-h] [-v]"


@pytest.mark.parametrize("run", ["mn2", "mn4"])
def test_a_killed_worker_is_named_from_the_heads_log(run: str) -> None:
    lines = lines_of(f"{run}-head.log")
    failure = classify_log(lines, node=HEAD, node_of_ip=NODE_OF_IP)
    # the failed node is the worker; the quoted lines are the head's
    assert failure is not None
    assert (failure.node, failure.kind) == (WORKER, "worker_died")
    assert failure.log_node == HEAD
    assert f"the worker {WORKER} (127.0.0.1)" in failure.cause
    assert any("Connection closed by peer [127.0.0.1]" in line for line in failure.excerpt)
    # the gate, fed the whole log (ready, then the kill), fails at the same line
    watch = BootWatch(head=HEAD, workers=[], started_at=0.0, node_of_ip=NODE_OF_IP)
    fed = feed(watch, HEAD, lines)
    assert fed is not None
    assert (fed.kind, fed.cause) == (failure.kind, failure.cause)
    unknown = classify_log(lines, node=HEAD, node_of_ip={})
    assert unknown is not None
    assert "at 127.0.0.1 (no node" in unknown.cause


def test_the_head_exiting_0_after_its_engine_died_is_a_failure() -> None:
    watch = BootWatch(head=HEAD, workers=[], started_at=0.0)
    assert feed(watch, HEAD, until(lines_of("mn2-head.log"), READY_LINE)) is None
    failure = watch.observe(ContainerExited(HEAD, 0, 99.0))
    assert failure is not None
    assert failure.kind == "container_exited"
    assert "exited with code 0 before any teardown" in failure.cause


def test_an_engine_that_dies_at_its_first_request_quotes_the_root_cause() -> None:
    failure = classify_log(lines_of("serve-headdim16.log"), node=HEAD)
    assert failure is not None
    assert failure.kind == "engine_core_fatal"
    assert "Unsupported CPU attention configuration: head_dim=16" in failure.cause


def test_a_deliberate_stop_is_not_a_failure() -> None:
    # serve.log and mn3-head.log end with SIGTERM; their teardown prints EngineDeadError
    assert classify_log(lines_of("serve.log"), node=HEAD) is None
    assert classify_log(lines_of("mn3-head.log"), node=HEAD) is None


# -- (b) the stand-in prints the real markers, in the real order, from the real processes ----

PROCESS_GROUP = Marker(
    "process_group", r"world_size=\d+ rank=\d+ local_rank=\d+ distributed_init_method=\S+ backend="
)
RANK_ASSIGNED = Marker("rank_assigned", HEADLESS_WORKER_JOINED.pattern)
COMPARED = (
    HEADLESS_WORKER_LAUNCHING,
    PROCESS_GROUP,
    RANK_ASSIGNED,
    *DEFAULT_BOOT_MARKERS,
    *DEFAULT_RECORDED_MARKERS,
)
_PROCESS = re.compile(r"^\((?P<process>[\w.-]+) pid=\d+\)")


def marker_sequence(lines: list[str]) -> list[tuple[str, str]]:
    """(marker, process) of each marker's first line, in log order (`""`: no prefix)."""
    seen: set[str] = set()
    sequence: list[tuple[str, str]] = []
    for line in lines:
        for marker in COMPARED:
            if marker.name not in seen and re.search(marker.pattern, line):
                seen.add(marker.name)
                process = _PROCESS.match(line)
                sequence.append((marker.name, process.group("process") if process else ""))
    return sequence


def common(
    ours: list[tuple[str, str]], real: list[tuple[str, str]]
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    both = {name for name, _ in ours} & {name for name, _ in real}
    return [m for m in ours if m[0] in both], [m for m in real if m[0] in both]


def test_marker_sequence_compares_order_and_processes() -> None:
    real = marker_sequence(lines_of("serve.log"))
    assert common(real, real)[0] == real
    swapped = [real[1], real[0], *real[2:]]
    assert common(swapped, real)[0] != common(swapped, real)[1]


def test_standin_single_node_prints_the_real_marker_sequence(engines: Engines) -> None:
    engine = engines.start("--served-model-name", "tiny", "--max-model-len", "1024")
    engine.wait_ready()
    ours, real = common(
        marker_sequence(engine.log().splitlines()), marker_sequence(lines_of("serve.log"))
    )
    assert ours == real
    assert len(real) >= 9


def test_standin_two_nodes_print_the_real_marker_sequences(engines: Engines) -> None:
    master_port = free_port()
    # worker first (as mn3): it prints Launching at once, and joins only when the head comes
    worker: Engine = engines.start(
        *node_flags(1, 2, master_port), env={"VLLM_RENDEZVOUS_TIMEOUT_S": "30"}
    )
    worker.wait_for_line(HEADLESS_WORKER_LAUNCHING.pattern)
    assert not re.search(HEADLESS_WORKER_JOINED.pattern, worker.log())
    head = engines.start(*node_flags(0, 2, master_port))
    head.wait_ready()
    worker.wait_for_line(HEADLESS_WORKER_JOINED.pattern)
    for ours_log, real_log in ((head.log(), "mn3-head.log"), (worker.log(), "mn3-worker.log")):
        ours, real = common(
            marker_sequence(ours_log.splitlines()), marker_sequence(lines_of(real_log))
        )
        assert ours == real, real_log
        assert len(real) >= 3
