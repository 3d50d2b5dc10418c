"""The readiness gate on literal vLLM log lines (0.11 and 0.33 forms) and a loopback HTTP server."""

from __future__ import annotations

import json
import pickle
import queue
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sparkdeploy.errors import BootFailed
from sparkdeploy.remote.engine_http import probe_endpoint
from sparkdeploy.steps.readiness_gate import GateEvent, ReadinessGate, follow_lines
from sparkdeploy.steps.readiness_gate.watch import (
    BootMarkers,
    BootWatch,
    ContainerExited,
    ContainerMissing,
    ExitStatus,
)
from sparkdeploy.vllm.log_lines import LogLine
from sparkdeploy.vllm.markers import DEFAULT_FAILURE_MARKERS, Marker

HEAD_0_11 = [
    "(APIServer pid=1) INFO 10-20 08:12:01 [api_server.py:1839] vLLM API server version 0.11.0",
    "(EngineCore_DP0 pid=291) INFO 10-20 08:12:40 [default_loader.py:267] "
    "Loading weights took 21.27 seconds",
    "(EngineCore_DP0 pid=291) INFO 10-20 08:12:41 [gpu_model_runner.py:2653] "
    "Model loading took 15.2683 GiB and 22.187164 seconds",
    "(EngineCore_DP0 pid=291) INFO 10-20 08:13:02 [gpu_worker.py:298] "
    "Available KV cache memory: 87.25 GiB",
    "(EngineCore_DP0 pid=291) INFO 10-20 08:13:03 [kv_cache_utils.py:1087] "
    "GPU KV cache size: 635,296 tokens",
    "(EngineCore_DP0 pid=291) INFO 10-20 08:13:03 [kv_cache_utils.py:1091] "
    "Maximum concurrency for 131,072 tokens per request: 4.85x",
    "(EngineCore_DP0 pid=291) INFO 10-20 08:13:30 [core.py:210] "
    "init engine (profile, create kv cache, warmup model) took 48.66 seconds",
    "(APIServer pid=1) INFO 10-20 08:13:31 [api_server.py:1971] "
    "Starting vLLM API server 0 on http://0.0.0.0:8000",
    "(APIServer pid=1) INFO:     Started server process [1]",
    "(APIServer pid=1) INFO:     Waiting for application startup.",
    "(APIServer pid=1) INFO:     Application startup complete.",
]

HEAD_0_33 = [
    "(Worker pid=80) INFO 09-18 02:00:10 [default_loader.py:291] "
    "Loading weights took 30.02 seconds",
    "(Worker pid=80) INFO 09-18 02:00:11 [gpu_model_runner.py:3120] "
    "Model loading took 92.72 GiB memory and 31.5 seconds",
    "(Worker pid=80) INFO 09-18 02:00:40 [gpu_worker.py:340] Available KV cache memory: 10.0 GiB",
    "(EngineCore pid=60) INFO 09-18 02:00:41 [kv_cache_utils.py:1230] GPU KV cache size: "
    "1,164,369 tokens, Maximum concurrency for 524,288 tokens per request: 2.22x",
    "(EngineCore pid=60) INFO 09-18 02:01:20 [core.py:250] "
    "init engine (profile, create kv cache, warmup model) took 69.4 s",
    "(APIServer pid=1) INFO 09-18 02:01:21 [api_server.py:2010] "
    "Starting vLLM server on http://0.0.0.0:8000",
    "INFO:     Started server process [1]",
    "INFO:     Waiting for application startup.",
    "INFO:     Application startup complete.",
]

WORKER_LAUNCHING = (
    "(MainProcess pid=7) INFO 09-18 02:00:02 [serve.py:224] Launching vLLM (v0.33.1) headless "
    "multiproc executor, with head node address 10.77.0.11:29501 for torch.distributed process "
    "group."
)
WORKER_JOIN = (
    "(Worker pid=9) INFO 09-18 02:00:30 [parallel_state.py:2350] rank 1 in world size 2 is "
    "assigned as DP rank 0, PP rank 0, PCP rank 0, TP rank 1, ETP rank 1, EP rank N/A, EPLB rank "
    "N/A"
)


CORE_ERROR = "(EngineCore pid=60) ERROR 09-18 02:00:30 [core.py:708]"


def feed(watch: BootWatch, node: str, lines: list[str], t0: float = 0.0) -> None:
    for offset, line in enumerate(lines):
        assert watch.observe(LogLine(node, line, t0 + offset)) is None, line


def test_0_11_boot_completes_with_every_figure() -> None:
    watch = BootWatch(head="node1", workers=[], started_at=0.0)
    feed(watch, "node1", HEAD_0_11)
    assert watch.complete
    assert watch.head_figures == {
        "weights_load_s": 21.27,
        "model_load_gib": 15.2683,
        "model_load_s": 22.187164,
        "kv_cache_gib": 87.25,
        "kv_cache_tokens": 635296.0,
        "max_concurrency_request_tokens": 131072.0,
        "max_concurrency": 4.85,
        "init_engine_s": 48.66,
    }
    assert watch.timeline[0].marker == "weights_loaded"
    assert watch.timeline[-1].marker == "application_ready"
    assert watch.timeline[-1].seconds == len(HEAD_0_11) - 1
    assert watch.timeline[-1].line == "Application startup complete."


def test_0_33_one_line_kv_cache_form_satisfies_both_kv_markers() -> None:
    watch = BootWatch(head="node1", workers=[], started_at=0.0)
    feed(watch, "node1", HEAD_0_33)
    assert watch.complete
    by_marker = {entry.marker: entry for entry in watch.timeline}
    assert by_marker["kv_cache_size"].figures == {"kv_cache_tokens": 1164369.0}
    assert by_marker["max_concurrency"].figures == {
        "max_concurrency_request_tokens": 524288.0,
        "max_concurrency": 2.22,
    }
    assert by_marker["kv_cache_size"].seconds == by_marker["max_concurrency"].seconds
    assert watch.head_figures["model_load_gib"] == 92.72
    assert watch.head_figures["init_engine_s"] == 69.4


def test_missing_marker_and_unjoined_worker_are_awaited_by_name() -> None:
    watch = BootWatch(head="node1", workers=["node2"], started_at=0.0)
    feed(watch, "node1", HEAD_0_33[:3])
    awaited = watch.awaited()
    assert awaited is not None
    assert awaited[:2] == ("node1", "engine_initialized")
    feed(watch, "node1", HEAD_0_33[3:])
    assert not watch.complete
    awaited = watch.awaited()
    assert awaited is not None
    assert awaited[:2] == ("node2", "headless_worker_joined")
    # The Launching line is printed at start-up, long before the worker joined: recorded only.
    feed(watch, "node2", [WORKER_LAUNCHING])
    assert not watch.complete
    assert watch.unjoined_workers() == ["node2"]
    assert watch.timeline[-1].marker == "headless_worker_launching"
    feed(watch, "node2", [WORKER_JOIN])
    assert watch.complete
    assert watch.unjoined_workers() == []
    assert (watch.timeline[-1].node, watch.timeline[-1].marker) == (
        "node2",
        "headless_worker_joined",
    )
    assert watch.timeline[-1].figures == {"rank": 1.0, "world_size": 2.0}


def test_markers_count_in_any_order_and_the_first_unseen_is_the_one_awaited() -> None:
    """Real vLLM prints them in order, but uvicorn's lines (stderr) and vLLM's (stdout) reach the
    gate on two streams: the gate needs each seen, not their order (README, readiness-gate)."""
    watch = BootWatch(head="node1", workers=[], started_at=0.0)
    feed(watch, "node1", HEAD_0_11[-3:])
    awaited = watch.awaited()
    assert awaited is not None
    assert awaited[:2] == ("node1", "weights_loaded")
    feed(watch, "node1", HEAD_0_11[:-3])
    assert watch.complete
    assert [entry.marker for entry in watch.timeline][:3] == [
        "uvicorn_started",
        "application_startup",
        "application_ready",
    ]


def test_optional_markers_are_recorded_but_never_awaited() -> None:
    watch = BootWatch(head="node1", workers=[], started_at=0.0)
    required_only = [line for line in HEAD_0_33 if "Model loading" not in line]
    required_only = [line for line in required_only if "KV cache" not in line]
    feed(watch, "node1", required_only)
    assert watch.complete
    assert "model_loaded" not in {entry.marker for entry in watch.timeline}


def test_recipe_markers_replace_the_defaults() -> None:
    glm_markers = [
        Marker("model_loaded", r"Model loading took (?P<model_load_gib>[\d.]+) GiB"),
        Marker("quantprobe_ok", r"\[quantprobe\].*algo=(?!None)"),
        Marker("kv_cache_size", r"GPU KV cache size: (?P<kv_cache_tokens>[\d,]+) tokens"),
        Marker("application_ready", r"Application startup complete"),
    ]
    watch = BootWatch(head="a", workers=[], started_at=0.0, markers=BootMarkers(boot=glm_markers))
    feed(watch, "a", [HEAD_0_33[1], "[quantprobe] layer 45 experts algo=MXFP8", *HEAD_0_33[3:]])
    assert watch.complete
    names = {m.name for m in glm_markers}
    assert [entry.marker for entry in watch.timeline if entry.marker in names] == [
        m.name for m in glm_markers
    ]
    # the defaults' recorded markers are still recorded (never awaited)
    assert {entry.marker for entry in watch.timeline} - names == {"max_concurrency"}


def test_free_memory_line_fails_naming_node_cause_and_context() -> None:
    watch = BootWatch(head="node1", workers=["node2"], started_at=0.0)
    feed(watch, "node2", [WORKER_JOIN, "INFO 09-18 02:00:03 [parallel_state.py:1200] rank 1"])
    fatal = (
        "(Worker pid=80) ValueError: Free memory on device cuda:0 (106.61/121.63 GiB) on startup "
        "is less than desired GPU memory utilization (0.9, 109.47 GiB). Decrease GPU memory "
        "utilization or reduce GPU memory used by other processes."
    )
    failure = watch.observe(LogLine("node2", fatal, 5.0))
    assert failure is not None
    assert failure.node == "node2"
    assert failure.kind == "free_memory_below_utilization"
    assert "106.61/121.63 GiB" in failure.cause
    assert failure.excerpt[-1] == fatal
    assert WORKER_JOIN in failure.excerpt
    error = failure.to_error(5.0)
    assert "node2" in str(error)
    assert "--gpu-memory-utilization" in str(error)


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        (
            "ValueError: To serve at least one request with the model's max seq len (524288), "
            "(30.5 GiB KV cache is needed, which is larger than the available KV cache memory "
            "(10.0 GiB). Based on the available memory, the estimated maximum model length is "
            "170000.",
            "kv_cache_too_small_for_max_len",
        ),
        (
            "ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine.",
            "no_kv_cache_memory",
        ),
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
            "cuda_out_of_memory",
        ),
        (
            "torch.distributed.DistNetworkError: The client socket has timed out after 600000ms "
            "while trying to connect to (10.77.0.11, 29501).",
            "distributed_connect_timeout",
        ),
        (
            "TimeoutError: Timed out waiting for engine core processes to start. This is often "
            "caused by slow weight loading. Waited 600s "
            "(configured by VLLM_ENGINE_READY_TIMEOUT_S)",
            "engine_ready_timeout",
        ),
    ],
)
def test_each_fatal_line_of_facts_is_named(line: str, kind: str) -> None:
    watch = BootWatch(head="node1", workers=[], started_at=0.0)
    failure = watch.observe(
        LogLine("node1", f"(EngineCore pid=60) ERROR 09-18 02:00:41 [core.py:700] {line}", 1.0)
    )
    assert failure is not None
    assert failure.kind == kind


def test_engine_core_init_failed_quotes_the_root_cause_above_it() -> None:
    watch = BootWatch(
        head="node1",
        workers=[],
        started_at=0.0,
        markers=BootMarkers(failure=DEFAULT_FAILURE_MARKERS),
    )
    feed(
        watch,
        "node1",
        [
            HEAD_0_33[0],
            f"{CORE_ERROR} EngineCore failed to start.",
            f"{CORE_ERROR} Traceback (most recent call last):",
            f'{CORE_ERROR}   File "pooled_indexer.py", line 88, in check_layout',
            f"{CORE_ERROR} ValueError: GLM MLA parent-page stride must be an exact number of C4 "
            "pages",
            "(APIServer pid=1) Traceback (most recent call last):",
            '(APIServer pid=1)   File "/usr/bin/vllm", line 8, in <module>',
        ],
    )
    failure = watch.observe(
        LogLine(
            "node1",
            "(APIServer pid=1) RuntimeError: Engine core "
            "initialization failed. See root cause above. Failed core "
            "proc(s): {}",
            9.0,
        )
    )
    assert failure is not None
    assert failure.kind == "engine_core_init_failed"
    assert "ValueError: GLM MLA parent-page stride must be an exact number of C4 pages" in (
        failure.cause
    )
    assert any("ValueError: GLM MLA parent-page stride" in line for line in failure.excerpt)
    assert failure.excerpt[-1].endswith("Failed core proc(s): {}")


def test_recipe_failure_marker_quantprobe_algo_none() -> None:
    watch = BootWatch(
        head="node1",
        workers=["node2"],
        started_at=0.0,
        markers=BootMarkers(
            failure=[
                *DEFAULT_FAILURE_MARKERS,
                Marker("quantprobe_broken", r"\[quantprobe\].*algo=None"),
            ]
        ),
    )
    assert watch.observe(LogLine("node1", "[quantprobe] mtp.experts algo=MXFP8", 1.0)) is None
    failure = watch.observe(LogLine("node2", "[quantprobe] mtp.experts algo=None", 2.0))
    assert failure is not None
    assert (failure.node, failure.kind) == ("node2", "quantprobe_broken")


def test_exit_137_is_an_oom_kill_only_when_docker_says_so() -> None:
    watch = BootWatch(head="node1", workers=["node2"], started_at=0.0)
    feed(watch, "node2", [WORKER_JOIN])
    oom = watch.observe(ContainerExited("node2", 137, 3.0, oom_killed=True))
    assert oom is not None
    assert oom.kind == "oom_killed"
    assert oom.node == "node2"
    assert "137" in oom.cause
    assert "OOMKilled is true" in oom.cause
    assert oom.excerpt == [WORKER_JOIN]
    assert "OOM-killed the container" in str(oom.to_error(3.0))

    killed = watch.observe(ContainerExited("node2", 137, 3.0, oom_killed=False))
    assert killed is not None
    assert killed.kind == "killed"
    assert "not an OOM: State.OOMKilled is false" in killed.cause
    assert "docker kill" in killed.cause
    assert "docker stop" in str(killed.to_error(3.0))

    unknown = watch.observe(ContainerExited("node2", 137, 3.0))
    assert unknown is not None
    assert unknown.kind == "killed"
    assert "unknown" in unknown.cause

    # The kernel's word wins over the code: an OOM kill of a child the engine survived, say.
    child = watch.observe(ContainerExited("node2", 1, 3.0, oom_killed=True))
    assert child is not None
    assert child.kind == "oom_killed"


def test_other_exits_quote_the_last_error() -> None:
    watch = BootWatch(head="node1", workers=["node2"], started_at=0.0)
    feed(watch, "node1", ["Traceback (most recent call last):", "KeyError: 'model_type'"])
    exited = watch.observe(ContainerExited("node1", 1, 4.0))
    assert exited is not None
    assert exited.kind == "container_exited"
    assert "code 1" in exited.cause
    assert "KeyError: 'model_type'" in exited.cause


def test_a_missing_container_is_named_with_what_docker_said() -> None:
    watch = BootWatch(head="node1", workers=["node2"], started_at=0.0)
    said = "Error response from daemon: No such container: sparkdeploy-x-node2"
    failure = watch.observe(ContainerMissing("node2", said, 0.2))
    assert failure is not None
    assert (failure.node, failure.kind) == ("node2", "container_missing")
    assert said in failure.cause
    assert failure.excerpt == [said]
    assert "run the boot step first" in str(failure.to_error(0.2))


def test_boot_failed_survives_pickling() -> None:
    watch = BootWatch(head="node1", workers=[], started_at=0.0)
    failure = watch.observe(ContainerExited("node1", 137, 1.0, oom_killed=True))
    assert failure is not None
    copy = pickle.loads(pickle.dumps(failure.to_error(1.0)))
    assert (copy.node, copy.kind, copy.excerpt) == ("node1", "oom_killed", failure.excerpt)


class FakeEngine:
    """/health and /v1/models on a loopback port; `serving` None means not listening yet."""

    def __init__(self, served_name: str) -> None:
        self.served_name = served_name
        self.health_status = 200
        self.completion_status = 200
        self.completions: list[dict[str, object]] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/health":
                    self.send_response(engine.health_status)
                    self.end_headers()
                elif self.path == "/v1/models":
                    body = json.dumps(
                        {"object": "list", "data": [{"id": engine.served_name}]}
                    ).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                else:
                    self.send_error(404)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                request = json.loads(self.rfile.read(length))
                engine.completions.append(request)
                if self.path != "/v1/completions" or engine.completion_status != 200:
                    self.send_error(engine.completion_status)
                    return
                body = json.dumps({"choices": [{"index": 0, "text": " a"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    fake = FakeEngine("dsv41")
    yield fake
    fake.close()


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def boot_events(node_lines: dict[str, list[str]]) -> queue.Queue[GateEvent]:
    events: queue.Queue[GateEvent] = queue.Queue()
    for node, lines in node_lines.items():
        for line in lines:
            events.put(LogLine(node, line, 0.0))
    return events


def test_probe_reports_refused_unhealthy_and_listed_names(engine: FakeEngine) -> None:
    refused = probe_endpoint(closed_port_url(), "dsv41", timeout=1.0)
    assert not refused.ready
    assert "refused" in refused.detail
    engine.health_status = 503
    assert probe_endpoint(engine.url, "dsv41", timeout=1.0).detail == "/health answered 503"
    engine.health_status = 200
    ready = probe_endpoint(engine.url, "dsv41", timeout=1.0)
    assert ready.ready
    assert ready.served_names == ["dsv41"]


def test_gate_is_ready_after_markers_and_health(engine: FakeEngine) -> None:
    gate = ReadinessGate(head="node1", workers=["node2"], started_at=0.0, clock=lambda: 0.0)
    events = boot_events({"node2": [WORKER_JOIN], "node1": HEAD_0_33})
    result = gate.wait(events, endpoint=engine.url, served_model_name="dsv41", timeout_s=30)
    assert result.figures["kv_cache_tokens"] == 1164369.0
    assert [entry.marker for entry in result.timeline[-2:]] == [
        "endpoint_healthy",
        "endpoint_ready",
    ]
    assert {entry.node for entry in result.timeline} == {"node1", "node2"}
    assert engine.completions == [
        {"model": "dsv41", "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    ]


def test_gate_fails_when_the_one_completion_fails(engine: FakeEngine) -> None:
    engine.completion_status = 500
    gate = ReadinessGate(head="node1")
    with pytest.raises(BootFailed) as caught:
        gate.wait(
            boot_events({"node1": HEAD_0_33}),
            endpoint=engine.url,
            served_model_name="dsv41",
            timeout_s=30,
        )
    assert caught.value.kind == "completion_failed"
    assert "500" in caught.value.cause
    assert len(engine.completions) == 1  # asked once, not polled


def test_a_head_exiting_with_code_0_is_a_failure() -> None:
    watch = BootWatch(head="node1", workers=[], started_at=0.0)
    feed(watch, "node1", HEAD_0_33[:2])
    failure = watch.observe(ContainerExited("node1", 0, 3.0))
    assert failure is not None
    assert failure.kind == "container_exited"
    assert "exited with code 0 before any teardown" in failure.cause


def test_gate_fails_on_a_wrong_served_name(engine: FakeEngine) -> None:
    gate = ReadinessGate(head="node1")
    with pytest.raises(BootFailed) as caught:
        gate.wait(
            boot_events({"node1": HEAD_0_33}),
            endpoint=engine.url,
            served_model_name="glm53",
            timeout_s=30,
        )
    assert caught.value.kind == "served_name_mismatch"
    assert "dsv41" in caught.value.cause


def test_gate_fails_on_a_fatal_line_long_before_its_timeout(engine: FakeEngine) -> None:
    gate = ReadinessGate(head="node1", workers=["node2"])
    events = boot_events({"node1": [*HEAD_0_33[:2], "torch.OutOfMemoryError: CUDA out of memory."]})
    with pytest.raises(BootFailed) as caught:
        gate.wait(events, endpoint=engine.url, served_model_name="dsv41", timeout_s=3600)
    assert (caught.value.node, caught.value.kind) == ("node1", "cuda_out_of_memory")
    assert [entry.marker for entry in gate.timeline] == ["weights_loaded", "model_loaded"]


def test_gate_times_out_naming_the_awaited_marker() -> None:
    gate = ReadinessGate(head="node1", workers=["node2"])
    events = boot_events({"node1": HEAD_0_33, "node2": ["INFO starting"]})
    with pytest.raises(BootFailed) as caught:
        gate.wait(events, endpoint=closed_port_url(), served_model_name="dsv41", timeout_s=0.5)
    error = caught.value
    assert (error.node, error.kind) == ("node2", "worker_never_joined")
    assert "the worker(s) node2 never joined (no rank-assignment line)" in error.cause
    assert error.excerpt[0] == "INFO starting"


def test_gate_timeout_says_when_the_endpoint_is_up_but_a_marker_never_matched(
    engine: FakeEngine,
) -> None:
    gate = ReadinessGate(
        head="node1", markers=BootMarkers(boot=[Marker("never", r"this line is never printed")])
    )
    with pytest.raises(BootFailed) as caught:
        gate.wait(
            boot_events({"node1": HEAD_0_33}),
            endpoint=engine.url,
            served_model_name="dsv41",
            timeout_s=0.3,
        )
    assert "marker pattern does not match" in caught.value.cause


def test_gate_waits_through_refused_connections_until_markers_and_health() -> None:
    gate = ReadinessGate(head="node1", health_poll_s=0.05)
    events = boot_events({"node1": HEAD_0_33})
    with pytest.raises(BootFailed) as caught:
        gate.wait(events, endpoint=closed_port_url(), served_model_name="dsv41", timeout_s=0.5)
    assert caught.value.kind == "timeout"
    assert "connection refused" in caught.value.cause


def test_follow_lines_feeds_lines_then_the_exit_status() -> None:
    events: queue.Queue[GateEvent] = queue.Queue()
    thread = follow_lines(events, "node3", [b"one\n", "two\r\n"], lambda: ExitStatus(137, True))
    thread.join(5)
    received = [events.get_nowait() for _ in range(3)]
    assert [(e.node, getattr(e, "line", None)) for e in received[:2]] == [
        ("node3", "one"),
        ("node3", "two"),
    ]
    assert isinstance(received[2], ContainerExited)
    assert received[2].exit_code == 137
    assert received[2].oom_killed is True
    assert events.empty()
