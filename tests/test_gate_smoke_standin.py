"""The gate and the smoke test against the lab's engine stand-in, run as local processes.

Each engine is `python lab/engine/vllm_standin.py serve ...` on 127.0.0.1 with a free port, an HF
cache holding a lab.tinymodel repo, and STANDIN_FAULT for the failure under test. Its stdout is
fed to the gate the way `docker logs -f` is in the field; its exit code (a SIGKILL read as 137,
as docker reports it) becomes the ContainerExited event. Every process is stopped by PID.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lab.testing.hfcache_layout import cache_repo
from lab.tinymodel import generate_repo
from sparkdeploy.errors import BootFailed
from sparkdeploy.steps.readiness_gate import GateEvent, GateResult, ReadinessGate, follow_lines
from sparkdeploy.steps.readiness_gate.watch import BootMarkers, ExitStatus
from sparkdeploy.steps.smoke_test import SmokeReport, SmokeSettings, run_smoke
from sparkdeploy.vllm.markers import DEFAULT_FAILURE_MARKERS, Marker

REPO_ROOT = Path(__file__).resolve().parent.parent
STANDIN = REPO_ROOT / "lab" / "engine" / "vllm_standin.py"
MODEL = "lab/tiny-chat"
SERVED = "tiny"
STOP_TIMEOUT_S = 5.0
GOOD_BOOT_TIMEOUT_S = 30.0
GLM_SMOKE = {"reasoning_effort": "low"}
SERVE_FLAGS = [
    "--reasoning-parser",
    "glm45",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "glm47",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def docker_exit_code(returncode: int) -> int:
    """A process killed by signal N exits -N for Popen and 128+N for docker."""
    return 128 - returncode if returncode < 0 else returncode


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("standin")
    repo = generate_repo(root / "repos", MODEL)
    cache = root / "hf-cache"
    cache_repo(repo, cache)
    return cache


@dataclass
class Engines:
    """Stand-in processes of one test; all stopped at its end."""

    hf_cache: Path
    events: queue.Queue[GateEvent] = field(default_factory=queue.Queue)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(
        self,
        node: str,
        args: Sequence[str],
        *,
        fault: str = "",
        env: dict[str, str] | None = None,
    ) -> None:
        process = subprocess.Popen(
            [sys.executable, str(STANDIN), "serve", MODEL, "--host", "127.0.0.1", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={
                **os.environ,
                "PYTHONPATH": str(REPO_ROOT),
                "HF_HUB_CACHE": str(self.hf_cache),
                "HF_HUB_OFFLINE": "1",
                "STANDIN_FAULT": fault,
                **(env or {}),
            },
            start_new_session=True,
        )
        self.processes.append(process)
        assert process.stdout is not None
        follow_lines(
            self.events,
            node,
            process.stdout,
            lambda: ExitStatus(docker_exit_code(process.wait(timeout=STOP_TIMEOUT_S)), None),
        )

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=STOP_TIMEOUT_S)


@pytest.fixture
def engines(hf_cache: Path) -> Iterator[Engines]:
    running = Engines(hf_cache)
    yield running
    running.stop()
    assert all(process.poll() is not None for process in running.processes)


def boot_one(
    engines: Engines, *, fault: str = "", env: dict[str, str] | None = None
) -> tuple[ReadinessGate, str]:
    port = free_port()
    gate = ReadinessGate(head="head")
    engines.start(
        "head",
        ["--port", str(port), "--served-model-name", SERVED, *SERVE_FLAGS],
        fault=fault,
        env=env,
    )
    return gate, f"http://127.0.0.1:{port}"


def wait(gate: ReadinessGate, engines: Engines, endpoint: str, timeout_s: float) -> GateResult:
    return gate.wait(
        engines.events, endpoint=endpoint, served_model_name=SERVED, timeout_s=timeout_s
    )


def smoke(endpoint: str) -> SmokeReport:
    return run_smoke(
        SmokeSettings(
            endpoint,
            SERVED,
            chat_template_kwargs=GLM_SMOKE,
            tool_calls=True,
            reasoning=True,
            request_timeout_s=5.0,
        )
    )


def test_good_boot_is_ready_with_its_timeline(engines: Engines) -> None:
    gate, endpoint = boot_one(engines)
    result = wait(gate, engines, endpoint, GOOD_BOOT_TIMEOUT_S)
    markers = [entry.marker for entry in result.timeline]
    assert markers[0] == "weights_loaded"
    assert markers[-3:] == [
        "application_ready",
        "endpoint_healthy",
        "endpoint_ready",
    ]
    assert result.figures["kv_cache_tokens"] > 0
    assert result.figures["max_concurrency"] > 0
    assert {"weights_load_s", "model_load_gib", "kv_cache_gib", "init_engine_s"} <= set(
        result.figures
    )


def test_two_node_boot_waits_for_the_headless_worker(engines: Engines) -> None:
    port, master_port = free_port(), free_port()
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    common += ["--tensor-parallel-size", "2", "--served-model-name", SERVED]
    gate = ReadinessGate(head="node1", workers=["node2"])
    engines.start("node1", [*common, "--node-rank", "0", "--port", str(port)])
    engines.start("node2", [*common, "--node-rank", "1", "--headless"])
    result = wait(gate, engines, f"http://127.0.0.1:{port}", GOOD_BOOT_TIMEOUT_S)
    joined = [entry for entry in result.timeline if entry.marker == "headless_worker_joined"]
    assert [entry.node for entry in joined] == ["node2"]


def test_recipe_failure_marker_catches_a_broken_quantprobe(engines: Engines) -> None:
    port = free_port()
    gate = ReadinessGate(
        head="head",
        markers=BootMarkers(
            failure=[
                *DEFAULT_FAILURE_MARKERS,
                Marker("quantprobe_broken", r"\[quantprobe\].*algo=None"),
            ]
        ),
    )
    engines.start(
        "head",
        ["--port", str(port), "--served-model-name", SERVED],
        env={"STANDIN_QUANTPROBE": "None"},
    )
    with pytest.raises(BootFailed) as caught:
        wait(gate, engines, f"http://127.0.0.1:{port}", GOOD_BOOT_TIMEOUT_S)
    assert caught.value.kind == "quantprobe_broken"


def test_smoke_passes_on_a_good_engine(engines: Engines) -> None:
    gate, endpoint = boot_one(engines)
    wait(gate, engines, endpoint, GOOD_BOOT_TIMEOUT_S)
    report = smoke(endpoint)
    assert report.passed, report.table_rows()
    streaming = report.check("streaming").figures
    assert streaming["ttft_s"] > 0
    assert streaming["decode_tok_s"] > 0
    # the engine's /metrics beside our count of the same requests
    engine = {figure.name: figure for figure in report.engine}
    for name in ("prompt_tokens", "generation_tokens", "requests_finished"):
        assert engine[name].engine == engine[name].ours, engine[name]
    hit_rate = engine["prefix_cache_hit_rate"].engine
    assert hit_rate is not None
    assert hit_rate > 0
    assert engine["preemptions"].engine == 0
    assert any(row["check"] == "engine /metrics: ttft_mean_s" for row in report.table_rows())
