"""The engine stand-in as local processes on loopback: boot, API, rendezvous, faults, Engram.

Every engine is a subprocess on 127.0.0.x with free ports and a temporary HF cache built from a
lab.tinymodel repo; the `engines` fixture kills each one it started, by PID.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lab.engine import standin_model
from lab.engine.standin_args import parse_command_line
from lab.engine.standin_faults import MARKER_NAMED_KINDS, Faults, FaultSpecError
from lab.engine.standin_log import EngineFatal
from lab.engine.standin_net import check_node_network, nccl_interfaces_matching
from lab.engine.vllm_standin import StandinEngine
from lab.testing.hfcache_layout import cache_repo
from lab.tinymodel import EngramSpec, GeneratedRepo, generate_repo
from sparkdeploy.node import engram
from sparkdeploy.vllm.markers import (
    DEFAULT_BOOT_MARKERS,
    DEFAULT_FAILURE_MARKERS,
    HEADLESS_WORKER_JOINED,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
STANDIN = REPO_ROOT / "lab" / "engine" / "vllm_standin.py"
MODEL = "lab/tiny-engram"
# 3 heads x 2 n-gram orders = 6 columns: every rank owns rows at TP 2 and at TP 3.
SPEC = EngramSpec(layer_ids=(1, 3), vocab_size=500, n_heads=3, max_ngram_size=3, head_dim=64)
WAIT_S = 15.0


# -- fixtures: a model, HF caches, engines ------------------------------------------------------


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> GeneratedRepo:
    return generate_repo(tmp_path_factory.mktemp("repos"), MODEL, engram=SPEC, tp_size=3)


@pytest.fixture(scope="module")
def hf_cache(repo: GeneratedRepo, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("hub")
    cache_repo(repo, cache)
    return cache


def geometry_of(repo: GeneratedRepo) -> engram.EngramGeometry:
    geometry = engram.EngramGeometry.from_config(repo.config)
    assert geometry is not None
    return geometry


def sparse_copy(
    source: Path, dest: Path, ranks: Sequence[int], tp: int, repo: GeneratedRepo
) -> None:
    """A full-size file with the header and only `ranks`' Engram rows, the rest holes."""
    header_len, tensors, _ = engram.read_safetensors_header(source)
    with open(source, "rb") as src, open(dest, "wb") as dst:
        dst.truncate(source.stat().st_size)
        dst.write(src.read(8 + header_len))
        for begin, end in engram.rank_byte_ranges(tensors, geometry_of(repo), ranks, tp):
            src.seek(begin)
            dst.seek(begin)
            dst.write(src.read(end - begin))


def composed_cache(root: Path, repo: GeneratedRepo, ranks: Sequence[int] | None, tp: int) -> Path:
    """An HF cache whose Engram shards are sparse copies for `ranks` (None: all holes)."""
    snapshot = cache_repo(repo, root)
    for shard in repo.engram_shards.values():
        link = snapshot / shard
        source = link.resolve()
        link.unlink()
        if ranks is None:
            with open(link, "wb") as empty:
                header_len = int.from_bytes(source.read_bytes()[:8], "little")
                empty.write(source.read_bytes()[: 8 + header_len])
                empty.truncate(source.stat().st_size)
        else:
            sparse_copy(source, link, ranks, tp, repo)
    return root


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port not handed out before: the kernel may offer a just-closed one again."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@dataclass
class Engine:
    process: subprocess.Popen[bytes]
    log_path: Path
    port: int | None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self, timeout: float = WAIT_S) -> int:
        return self.process.wait(timeout=timeout)

    def wait_for_line(self, pattern: str, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.log()):
            if time.monotonic() > deadline:
                raise AssertionError(f"no line matching {pattern!r} in:\n{self.log()}")
            time.sleep(0.02)

    def wait_ready(self, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"engine exited {self.process.returncode}:\n{self.log()}")
            try:
                if get(self.url("/health"), timeout=1)[0] == 200:
                    return
            except OSError:
                time.sleep(0.02)
        raise AssertionError(f"engine not ready:\n{self.log()}")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


class Engines:
    def __init__(self, workdir: Path, hf_cache: Path) -> None:
        self.workdir = workdir
        self.hf_cache = hf_cache
        self.started: list[Engine] = []

    def start(
        self,
        *flags: str,
        env: dict[str, str] | None = None,
        hf_cache: Path | None = None,
        script: Path = STANDIN,
        model: str = MODEL,
    ) -> Engine:
        port = None if "--headless" in flags else free_port()
        argv = [sys.executable, str(script), "serve", model, *flags]
        if port is not None:
            argv += ["--host", "127.0.0.1", "--port", str(port)]
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("STANDIN_", "VLLM_"))}
        full_env.update(
            HF_HUB_OFFLINE="1",
            HF_HUB_CACHE=str(hf_cache or self.hf_cache),
            STANDIN_DECODE_DELAY_S="0",
            PYTHONPATH=str(REPO_ROOT) if script == STANDIN else "",
        )
        full_env.update(env or {})
        log_path = self.workdir / f"engine-{len(self.started)}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env)
        engine = Engine(process, log_path, port)
        self.started.append(engine)
        return engine

    def stop_all(self) -> None:
        for engine in self.started:
            if engine.process.poll() is None:
                engine.process.kill()
            engine.process.wait(timeout=WAIT_S)


@pytest.fixture
def engines(tmp_path: Path, hf_cache: Path) -> Iterator[Engines]:
    running = Engines(tmp_path, hf_cache)
    try:
        yield running
    finally:
        running.stop_all()


@pytest.fixture(scope="module")
def plain_engine(hf_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """One engine without parsers, shared by the tests that only send requests."""
    running = Engines(tmp_path_factory.mktemp("plain"), hf_cache)
    try:
        engine = running.start("--served-model-name", "tiny", "--max-model-len", "2048")
        engine.wait_ready()
        yield engine
    finally:
        running.stop_all()


def run_in_process(
    capsys: pytest.CaptureFixture[str],
    hf_cache: Path,
    *flags: str,
    env: dict[str, str] | None = None,
    model: str = MODEL,
) -> tuple[int, str]:
    """A boot that fails before serving, run in this process: (exit code, its output)."""
    args = parse_command_line(["serve", model, "--host", "127.0.0.1", "--port", "0", *flags])
    full_env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hf_cache), **(env or {})}
    code = StandinEngine(args, full_env).run()
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def post(url: str, body: dict[str, Any], timeout: float = 5) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            raw = reply.read()
            return reply.status, raw if body.get("stream") else json.loads(raw)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def chat(engine: Engine, prompt: str, **extra: Any) -> dict[str, Any]:
    status, reply = post(
        engine.url("/v1/chat/completions"),
        {"messages": [{"role": "user", "content": prompt}], "temperature": 0, **extra},
    )
    assert status == 200, reply
    assert isinstance(reply, dict)
    return reply


def content_of(reply: dict[str, Any]) -> str | None:
    content = reply["choices"][0]["message"]["content"]
    assert content is None or isinstance(content, str)
    return content


CANARIES = (
    ("What is 127*43? Answer with the number.", "5461"),
    ("What is Fib(10)?", "55"),
    ('Reverse the word "accuracy".', "ycarucca"),
)


# -- single node: log lines, API, canaries --------------------------------------------------


def success_count(engine: Engine) -> float:
    metrics = get(engine.url("/metrics"))[1].decode()
    found = re.search(r'vllm:request_success_total\{.*finished_reason="stop"\} ([\d.]+)', metrics)
    assert found, metrics
    return float(found.group(1))


def test_single_node_prints_vllm_markers_in_order_then_serves(plain_engine: Engine) -> None:
    engine = plain_engine
    log = engine.log()
    positions = []
    for marker in DEFAULT_BOOT_MARKERS:
        match = re.search(marker.pattern, log)
        assert match, f"marker {marker.name} missing:\n{log}"
        positions.append(match.start())
    assert positions == sorted(positions)
    assert "Maximum concurrency for 2,048 tokens per request" in log

    assert json.loads(get(engine.url("/v1/models"))[1])["data"][0]["id"] == "tiny"
    assert json.loads(get(engine.url("/version"))[1])["version"]
    assert "server_load" in json.loads(get(engine.url("/load"))[1])
    successes = success_count(engine)
    for prompt, expected in CANARIES:
        assert expected in (content_of(chat(engine, prompt, model="tiny")) or "")
    assert success_count(engine) == successes + len(CANARIES)
    status, missing = post(
        engine.url("/v1/chat/completions"),
        {"model": "other", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert status == 404
    assert "other" in missing["error"]["message"]


def test_long_prompt_and_streaming_with_usage(plain_engine: Engine) -> None:
    engine = plain_engine
    long_prompt = " ".join(f"word{index}" for index in range(100)) + " What is 127*43?"
    reply = chat(engine, long_prompt)
    assert reply["usage"]["prompt_tokens"] > 64
    assert "5461" in (content_of(reply) or "")

    status, raw = post(
        engine.url("/v1/chat/completions"),
        {
            "messages": [{"role": "user", "content": "What is Fib(10)?"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == content_of(chat(engine, "What is Fib(10)?"))
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] > 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_ignore_eos_generates_up_to_max_tokens(plain_engine: Engine) -> None:
    reply = chat(plain_engine, "What is 127*43?", max_tokens=40, ignore_eos=True)
    assert reply["usage"]["completion_tokens"] == 40
    assert reply["choices"][0]["finish_reason"] == "length"
    assert (content_of(reply) or "").startswith("127 * 43 = 5461.")
    assert chat(plain_engine, "What is 127*43?", max_tokens=40)["usage"]["completion_tokens"] < 40


def test_metrics_carry_the_real_engines_names_and_count_what_was_served(
    engines: Engines,
) -> None:
    """Every vllm:* sample name the stand-in exports is on the real vLLM 0.32 page
    (tests/fixtures/vllm-0.32-cpu/metrics.txt), and the figures we read count the requests."""
    from sparkdeploy.remote.engine_http import scrape_metrics
    from sparkdeploy.steps.smoke_test import SmokeSettings, chat_stream
    from sparkdeploy.vllm.metrics import parse_metrics, parse_samples

    engine = engines.start("--served-model-name", "tiny", "--block-size", "16")
    engine.wait_ready()
    real = REPO_ROOT / "tests" / "fixtures" / "vllm-0.32-cpu" / "metrics.txt"
    real_names = {sample.name for sample in parse_samples(real.read_text())}
    before = scrape_metrics(engine.url(""))
    assert before.metrics is not None
    assert before.metrics.missing == ()
    settings = SmokeSettings(engine.url(""), "tiny", max_tokens=12, extra_body={"ignore_eos": True})
    prompt = " ".join(f"word{index}" for index in range(40))  # 46 tokens with the template's
    replies = [chat_stream(settings, f"r{index}", prompt) for index in range(3)]
    page = get(engine.url("/metrics"))[1].decode()
    ours = {sample.name for sample in parse_samples(page) if sample.name.startswith("vllm:")}
    assert ours <= real_names, ours - real_names
    activity = parse_metrics(page).minus(before.metrics)
    assert activity.requests_finished == 3
    assert activity.generation_tokens == 3 * 12
    assert activity.prompt_tokens == sum(r.reply.usage["prompt_tokens"] for r in replies)
    assert activity.ttft.count == 3
    assert activity.e2e.count == 3
    assert activity.itl.count == 3 * (12 - 1)
    # the prompt's 2 whole 16-token blocks are cached after the first request
    assert activity.prefix_cache_hits == 2 * 2 * 16
    assert activity.preemptions == 0


def test_reasoning_parser_and_auto_tool_choice(engines: Engines) -> None:
    engine = engines.start(
        "--reasoning-parser", "glm45", "--enable-auto-tool-choice", "--tool-call-parser", "glm47"
    )
    engine.wait_ready()
    low = chat(engine, "What is 127*43?", chat_template_kwargs={"reasoning_effort": "low"})
    message = low["choices"][0]["message"]
    assert message["reasoning"]
    assert message["reasoning_content"] == message["reasoning"]
    assert "5461" in message["content"]
    # GLM's template thinks at maximum effort unless told otherwise: a short budget is all
    # reasoning and no content, the failure the recipe's chat_template_kwargs prevents.
    untold = chat(engine, "What is 127*43?", max_tokens=64)
    assert content_of(untold) is None
    assert untold["choices"][0]["finish_reason"] == "length"

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    called = chat(engine, "What is the weather in Paris?", tools=tools)
    call = called["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert called["choices"][0]["finish_reason"] == "tool_calls"


def test_tools_without_auto_tool_choice_are_refused(plain_engine: Engine) -> None:
    status, reply = post(
        plain_engine.url("/v1/chat/completions"),
        {
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        },
    )
    assert status == 400
    assert "--enable-auto-tool-choice" in reply["error"]["message"]


def test_api_port_is_bound_but_refuses_connections_until_ready(engines: Engines) -> None:
    engine = engines.start(env={"STANDIN_FAULT": "slow_boot:2"})
    engine.wait_for_line(r"non-default args")
    assert engine.port is not None
    with socket.socket() as other:
        with pytest.raises(OSError, match=re.escape(os.strerror(errno.EADDRINUSE))) as taken:
            other.bind(("127.0.0.1", engine.port))
        assert taken.value.errno == errno.EADDRINUSE
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", engine.port), timeout=2).close()
    engine.wait_ready()
    took = re.search(r"Loading weights took ([\d.]+) seconds", engine.log())
    assert took
    assert float(took.group(1)) >= 2.0


def test_quantprobe_marker(engines: Engines) -> None:
    mxfp8 = engines.start(env={"STANDIN_QUANTPROBE": "MXFP8"})
    broken = engines.start(env={"STANDIN_QUANTPROBE": "None"})
    mxfp8.wait_ready()
    broken.wait_ready()
    assert re.search(r"\[quantprobe\] .*algo=MXFP8", mxfp8.log())
    assert re.search(r"\[quantprobe\] .*algo=None", broken.log())


def test_runs_from_a_flat_copy_as_in_the_image(engines: Engines, tmp_path: Path) -> None:
    flat = tmp_path / "standin"
    flat.mkdir()
    for source in [
        *(REPO_ROOT / "lab" / "engine").glob("*.py"),
        REPO_ROOT / "sparkdeploy" / "node" / "engram.py",
        REPO_ROOT / "sparkdeploy" / "errors.py",
        REPO_ROOT / "sparkdeploy" / "vllm" / "kv_cache.py",
        REPO_ROOT / "lab" / "tinymodel.py",
    ]:
        shutil.copy(source, flat / source.name)
    engine = engines.start("-tp", "3", script=flat / "vllm_standin.py")
    engine.wait_ready()
    assert "TP rank 2/3" in engine.log()
    assert "5461" in (content_of(chat(engine, "127 * 43 = ?")) or "")


# -- the command line ---------------------------------------------------------------------

SEED_ARGS = [
    *("--served-model-name", "dsv41", "--trust-remote-code"),
    *("--distributed-executor-backend", "mp", "--gpu-memory-utilization", "0.88"),
    *("--max-model-len", "524288", "--decode-context-parallel-size", "1"),
    *("--max-num-seqs", "4", "--max-num-batched-tokens", "4096", "--prefill-compute-share", "0.4"),
    *("--block-size", "256", "--enable-chunked-prefill", "--enable-prefix-caching"),
    *("--kv-cache-dtype", "fp8", "--attention-backend", "B12X", "--linear-backend", "b12x"),
    *("--moe-backend", "b12x", "--compilation-config", '{"cudagraph_mode":"FULL_AND_PIECEWISE"}'),
    *("--max_cudagraph_capture_size", "128"),
    *("--speculative-config", '{"method":"dspark","num_speculative_tokens":7}'),
    *("--engram-config", '{"cpu_offload":false,"table_memory":"disk"}'),
    *("--load-format", "instanttensor", "--safetensors-load-strategy", "lazy"),
    *("--generation-config", "vllm", "--override-generation-config", '{"temperature":1.0}'),
    *("--limit-mm-per-prompt", '{"image":2}', "--reasoning-parser", "deepseek_v41"),
    *("--tool-call-parser", "deepseek_v41", "--enable-auto-tool-choice"),
    *("--jit-monitor-mode", "error", "--kv-cache-memory-bytes", "10737418240"),
    *("--async-scheduling", "--disable-custom-all-reduce", "--language-model-only"),
    *("--kernel-config", '{"enable_cutedsl_warmup":false,"enable_flashinfer_autotune":false}'),
    *("--tensor-parallel-size", "4", "--pipeline-parallel-size", "1"),
    *("--nnodes", "4", "--node-rank", "1", "--master-addr", "10.77.0.11"),
    *("--master-port", "29501", "--headless"),
]


def test_every_seed_flag_is_accepted() -> None:
    args = parse_command_line(["serve", "deepseek-ai/DeepSeek-V4.1-Flash", *SEED_ARGS])
    assert args.model == "deepseek-ai/DeepSeek-V4.1-Flash"
    assert args.max_cudagraph_capture_size == 128
    assert args.engram_config == {"cpu_offload": False, "table_memory": "disk"}
    assert (args.nnodes, args.node_rank, args.headless) == (4, 1, True)
    assert parse_command_line(["serve", "--model", "org/m"]).model == "org/m"


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (
            ["--speculative-config", '\'{"method":"dspark"}\''],
            r"argument --speculative-config: 1 validation error for SpeculativeConfig",
        ),
        (
            ["--compilation-config", "{not json}"],
            r"argument --compilation-config/-cc: 1 validation error for CompilationConfig",
        ),
        (["--limit-mm-per-prompt", "'{\"image\":2}'"], r"argument --limit-mm-per-prompt: invalid"),
        (["--port", "eighty"], r"argument --port: invalid int value"),
    ],
)
def test_bad_flags_exit_2_with_argparse_usage(
    capsys: pytest.CaptureFixture[str], flags: list[str], error: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_command_line(["serve", MODEL, *flags])
    assert exited.value.code == 2
    printed = capsys.readouterr().err
    assert printed.startswith("usage: vllm serve [model_tag] [options]")
    assert re.search(r"vllm serve: error: " + error, printed), printed


def test_unknown_flag_is_reported_by_the_top_parser_as_in_vllm_0_32(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_command_line(["serve", MODEL, "--bogus-flag", "1"])
    assert exited.value.code == 2
    printed = capsys.readouterr().err.splitlines()
    real = (REPO_ROOT / "tests/fixtures/vllm-0.32-cpu/fail-unknown-flag.log").read_text()
    # the real log starts with a Triton warning the stand-in has no reason to print
    assert printed == real.splitlines()[1:]


def test_ray_backend_with_nnodes_is_an_error(
    capsys: pytest.CaptureFixture[str], hf_cache: Path
) -> None:
    code, printed = run_in_process(
        capsys, hf_cache, "--distributed-executor-backend", "ray", "--nnodes", "2", "-tp", "2"
    )
    assert code == 1
    assert "needs distributed_executor_backend='mp'" in printed


# -- the node's network -------------------------------------------------------------------


def test_nccl_interface_spec_semantics() -> None:
    names = ["lo", "enp1s0f1np1", "docker0"]
    assert nccl_interfaces_matching("enp", names) == ["enp1s0f1np1"]
    assert nccl_interfaces_matching("^docker,lo", names) == ["enp1s0f1np1"]
    assert nccl_interfaces_matching("=enp1s0", names) == []
    assert nccl_interfaces_matching("=lo", names) == ["lo"]


def test_local_host_ip_and_existing_interfaces_pass() -> None:
    check_node_network({"VLLM_HOST_IP": "127.0.0.3", "NCCL_SOCKET_IFNAME": "lo"})
    check_node_network({"GLOO_SOCKET_IFNAME": "lo"})


@pytest.mark.parametrize(
    ("env", "line"),
    [
        # 192.0.2.0/24 is TEST-NET-1: binding it fails unless this host has it; nothing is sent.
        (
            {"VLLM_HOST_IP": "192.0.2.123"},
            r"DistNetworkError: The server socket has failed to bind",
        ),
        ({"NCCL_SOCKET_IFNAME": "enp9s9f9np9"}, r"NCCL WARN Bootstrap : no socket interface found"),
        ({"GLOO_SOCKET_IFNAME": "enp9s9f9np9"}, r"Unable to find address for: enp9s9f9np9"),
    ],
)
def test_wrong_host_ip_or_interface_fails_before_loading(
    capsys: pytest.CaptureFixture[str], hf_cache: Path, env: dict[str, str], line: str
) -> None:
    if env.get("VLLM_HOST_IP") in _local_addresses():
        pytest.skip("this host has the TEST-NET address")
    code, printed = run_in_process(capsys, hf_cache, env=env)
    assert code == 1, printed
    assert re.search(line, printed), printed
    assert "Loading weights" not in printed


def _local_addresses() -> set[str]:
    with open("/proc/net/fib_trie") as trie:
        return set(re.findall(r"\|-- (\d+\.\d+\.\d+\.\d+)\n\s+/32 host LOCAL", trie.read()))


# -- multi-node rendezvous ----------------------------------------------------------------


def node_flags(rank: int, nnodes: int, master_port: int, master: str = "127.0.0.1") -> list[str]:
    flags = [
        *("--tensor-parallel-size", str(nnodes), "--distributed-executor-backend", "mp"),
        *("--nnodes", str(nnodes), "--node-rank", str(rank)),
        *("--master-addr", master, "--master-port", str(master_port)),
    ]
    return [*flags, "--headless"] if rank else flags


def test_three_nodes_rendezvous_verify_their_rows_and_answer(
    engines: Engines, repo: GeneratedRepo, tmp_path: Path
) -> None:
    master_port = free_port()
    nodes = []
    for rank in range(3):
        cache = composed_cache(tmp_path / f"node{rank}", repo, [rank], 3)
        nodes.append(
            engines.start(
                *node_flags(rank, 3, master_port),
                env={"VLLM_HOST_IP": f"127.0.0.{rank + 1}"},
                hf_cache=cache,
            )
        )
    head, workers = nodes[0], nodes[1:]
    head.wait_ready()
    assert "5461" in (content_of(chat(head, "127*43")) or "")
    for rank, worker in enumerate(workers, start=1):
        log = worker.log()
        assert re.search(HEADLESS_WORKER_JOINED.pattern, log)
        assert f"TP rank {rank}/3" in log
        assert "Model loading took" in log
    assert head.log().count("joined the process group") == 2
    head.process.send_signal(signal.SIGTERM)
    assert head.wait_exit() == 0
    assert [worker.wait_exit() for worker in workers] == [0, 0]


def test_workers_exit_when_the_head_dies(engines: Engines) -> None:
    master_port = free_port()
    head = engines.start(*node_flags(0, 2, master_port))
    worker = engines.start(*node_flags(1, 2, master_port))
    head.wait_ready()
    head.process.kill()
    assert worker.wait_exit() == 1
    assert "connection to the head" in worker.log()


def test_a_worker_dying_after_ready_kills_the_head(engines: Engines) -> None:
    master_port = free_port()
    head = engines.start(*node_flags(0, 2, master_port))
    worker = engines.start(
        *node_flags(1, 2, master_port), env={"STANDIN_FAULT": "die_after_ready:0.3"}
    )
    assert worker.wait_exit() == 1
    assert head.wait_exit() == 0  # vLLM 0.32's head exits 0 once its engine died
    log = head.log()
    assert log.index("Application startup complete") < log.index("Connection closed by peer")
    assert log.index("Connection closed by peer [127.0.0.1]") < log.index("EngineDeadError")
    assert "the worker on node rank 1" in log


def test_worker_with_a_wrong_master_address_times_out(engines: Engines) -> None:
    port = free_port()
    worker = engines.start(
        *node_flags(1, 2, port, master="127.0.0.9"), env={"VLLM_RENDEZVOUS_TIMEOUT_S": "1"}
    )
    assert worker.wait_exit() == 1
    log = worker.log()
    assert re.search(
        r"DistNetworkError: The client socket has timed out after 1000ms while trying to "
        rf"connect to \(127\.0\.0\.9, {port}\)",
        log,
    )
    assert not re.search(HEADLESS_WORKER_JOINED.pattern, log)


def test_head_whose_workers_never_come_times_out(engines: Engines) -> None:
    head = engines.start(*node_flags(0, 2, free_port()), env={"VLLM_ENGINE_READY_TIMEOUT_S": "1"})
    assert head.wait_exit() == 1
    assert re.search(
        r"TimeoutError: Timed out waiting for engine core processes to start.*Waited 1s",
        head.log(),
    )


def test_worker_with_other_ranks_rows_fails_the_boot(
    engines: Engines, repo: GeneratedRepo, tmp_path: Path
) -> None:
    master_port = free_port()
    head = engines.start(*node_flags(0, 2, master_port))
    worker = engines.start(
        *node_flags(1, 2, master_port), hf_cache=composed_cache(tmp_path / "w", repo, [0], 2)
    )
    assert worker.wait_exit() == 1
    assert head.wait_exit() == 1
    assert re.search(
        r"Engram tensor layers\.1\.engram\.embed\.\w+ rows .* TP rank 1/2", worker.log()
    )
    assert "all zeros" in worker.log()
    assert "node rank 1" in head.log()
    assert "Engine core initialization failed" in head.log()


def test_fault_switch_can_target_one_node_rank(engines: Engines) -> None:
    master_port = free_port()
    head = engines.start(*node_flags(0, 2, master_port), env={"STANDIN_FAULT": "crash@1"})
    worker = engines.start(*node_flags(1, 2, master_port), env={"STANDIN_FAULT": "crash@1"})
    assert worker.wait_exit() == 1
    assert head.wait_exit() == 1
    assert "Traceback" in worker.log()
    assert "Traceback" not in head.log()


# -- Engram rows, in process --------------------------------------------------------------


@pytest.mark.parametrize(
    ("copy_ranks", "check_rank", "problem"),
    [
        ([1], 1, None),
        ([0, 1], 1, None),
        (None, 0, "all zeros"),
        ([0], 1, "all zeros"),
        ([2], 1, "all zeros"),
    ],
)
def test_engram_rows_of_a_sparse_copy(
    repo: GeneratedRepo,
    tmp_path: Path,
    copy_ranks: list[int] | None,
    check_rank: int,
    problem: str | None,
) -> None:
    cache = composed_cache(tmp_path, repo, copy_ranks, 3)
    model = standin_model.load_model(MODEL, None, {"HF_HUB_CACHE": str(cache)})
    if problem is None:
        checked = standin_model.verify_engram_rows(model, [check_rank], 3)
        assert len(checked) == len(SPEC.layer_ids)
        return
    with pytest.raises(EngineFatal) as failed:
        standin_model.verify_engram_rows(model, [check_rank], 3)
    assert problem in failed.value.lines[-1]
    assert f"TP rank {check_rank}/3" in failed.value.lines[-1]


def test_engram_rows_with_wrong_content(repo: GeneratedRepo, tmp_path: Path) -> None:
    cache = composed_cache(tmp_path, repo, [1], 3)
    model = standin_model.load_model(MODEL, None, {"HF_HUB_CACHE": str(cache)})
    geometry = geometry_of(repo)
    shard = next(s for s in model.shards if engram.weight_tensor_name(1) in s.tensors)
    weight = shard.tensors[engram.weight_tensor_name(1)]
    _, last = geometry.rank_rows(0, 1, 3)
    with open(shard.path, "r+b") as handle:
        handle.seek(weight.begin + (last - 1) * weight.row_width)
        handle.write(b"\x07" * weight.row_width)
    with pytest.raises(EngineFatal) as failed:
        standin_model.verify_engram_rows(model, [1], 3)
    assert "differs from the checkpoint's content" in failed.value.lines[-1]


def test_missing_repo_fails_as_offline_huggingface_hub(
    capsys: pytest.CaptureFixture[str], hf_cache: Path
) -> None:
    code, printed = run_in_process(capsys, hf_cache, model="lab/not-cached")
    assert code == 1
    assert "LocalEntryNotFoundError" in printed
    assert "Engine core initialization failed" in printed


# -- fault switches -----------------------------------------------------------------------

FATAL_KINDS = {
    "free_memory": "free_memory_below_utilization",
    "kv_cache_needed": "kv_cache_too_small_for_max_len",
    "no_cache_blocks": "no_kv_cache_memory",
    "cuda_oom": "cuda_out_of_memory",
    "dist_network": "distributed_connect_timeout",
    "engine_timeout": "engine_ready_timeout",
    "engine_core_failed": "engine_core_init_failed",
    **{kind: kind for kind in MARKER_NAMED_KINDS},
}
SEED_FATAL_LINES = {
    "glm_mla_stride": "GLM MLA parent-page stride must be an exact number of C4 pages",
    "fp8_kv_fa3": "FP8 KV cache requires FA3 on SM90 or FA4 on SM100",
}


@pytest.mark.parametrize("kind", [*FATAL_KINDS, *SEED_FATAL_LINES])
def test_fatal_switch_prints_the_line_the_gate_knows(
    capsys: pytest.CaptureFixture[str], hf_cache: Path, kind: str
) -> None:
    code, printed = run_in_process(capsys, hf_cache, env={"STANDIN_FAULT": f"fatal:{kind}"})
    assert code == 1
    if kind in FATAL_KINDS:
        marker = next(m for m in DEFAULT_FAILURE_MARKERS if m.name == FATAL_KINDS[kind])
        assert re.search(marker.pattern, printed), printed
    else:
        assert SEED_FATAL_LINES[kind] in printed
    assert "Application startup complete" not in printed


def test_emergent_memory_failures(capsys: pytest.CaptureFixture[str], hf_cache: Path) -> None:
    code, printed = run_in_process(capsys, hf_cache, env={"STANDIN_GPU_FREE_GIB": "100"})
    assert code == 1
    assert "Free memory on device cuda:0 (100.00/121.63 GiB)" in printed
    code, printed = run_in_process(
        capsys, hf_cache, "--kv-cache-memory-bytes", "64K", "--max-model-len", "524288"
    )
    assert code == 1
    assert "max seq len (524288)" in printed


def test_crash_during_load(capsys: pytest.CaptureFixture[str], hf_cache: Path) -> None:
    code, printed = run_in_process(capsys, hf_cache, env={"STANDIN_FAULT": "crash"})
    assert code == 1
    assert "Traceback (most recent call last)" in printed
    assert "Engine core initialization failed" in printed


def test_exit137_kills_itself(engines: Engines) -> None:
    engine = engines.start(env={"STANDIN_FAULT": "exit137"})
    assert engine.wait_exit() in (-signal.SIGKILL, 137)


def test_hang_never_gets_ready_and_stops_on_sigterm(engines: Engines) -> None:
    engine = engines.start(env={"STANDIN_FAULT": "hang"})
    engine.wait_for_line(r"non-default args")
    assert engine.port is not None
    with pytest.raises(subprocess.TimeoutExpired):
        engine.process.wait(timeout=1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", engine.port), timeout=2).close()
    engine.process.send_signal(signal.SIGTERM)
    assert engine.wait_exit() == 0
    assert "Loading weights took" not in engine.log()


def test_slow_boot_past_the_engine_ready_timeout(
    capsys: pytest.CaptureFixture[str], hf_cache: Path
) -> None:
    code, printed = run_in_process(
        capsys,
        hf_cache,
        env={"STANDIN_FAULT": "slow_boot:30", "VLLM_ENGINE_READY_TIMEOUT_S": "0.5"},
    )
    assert code == 1
    assert "TimeoutError: Timed out waiting for engine core processes" in printed


def test_token_loop_garbled_and_empty(engines: Engines) -> None:
    loop = engines.start(env={"STANDIN_FAULT": "token_loop"})
    garbled = engines.start(env={"STANDIN_FAULT": "garbled"})
    empty = engines.start(env={"STANDIN_FAULT": "empty_content"})
    for engine in (loop, garbled, empty):
        engine.wait_ready()
    looped = chat(loop, "What is 127*43?", max_tokens=40)
    words = (content_of(looped) or "").split()
    assert len(words) > 20
    assert len(set(words)) <= 4
    assert looped["choices"][0]["finish_reason"] == "length"
    assert "5461" not in (content_of(chat(garbled, "What is 127*43?")) or "")
    assert content_of(chat(empty, "What is 127*43?")) == ""


def test_bad_after_five_requests(engines: Engines) -> None:
    engine = engines.start(env={"STANDIN_FAULT": "bad_after:5"})
    engine.wait_ready()
    answers = [content_of(chat(engine, "What is 127*43?")) or "" for _ in range(7)]
    assert ["5461" in answer for answer in answers] == [True] * 5 + [False] * 2


def test_hang_on_long_prompts_only(engines: Engines) -> None:
    engine = engines.start(env={"STANDIN_FAULT": "hang_long_prompt"})
    engine.wait_ready()
    assert "5461" in (content_of(chat(engine, "What is 127*43?")) or "")
    long_prompt = " ".join(f"word{index}" for index in range(80))
    with pytest.raises(TimeoutError):
        post(
            engine.url("/v1/chat/completions"),
            {"messages": [{"role": "user", "content": long_prompt}]},
            timeout=1,
        )


def test_die_after_ready_turns_health_503_then_exits(engines: Engines) -> None:
    engine = engines.start(env={"STANDIN_FAULT": "die_after_ready:0.3", "STANDIN_DEAD_EXIT_S": "2"})
    engine.wait_ready()
    engine.wait_for_line(r"EngineDeadError")
    assert get(engine.url("/health"))[0] == 503
    assert engine.wait_exit() == 0  # as vLLM: status 0 after the engine died


def test_fail_requests_answers_500_while_its_file_exists_and_health_stays_200(
    engines: Engines, tmp_path: Path
) -> None:
    switch = tmp_path / "fail-requests"
    engine = engines.start(env={"STANDIN_FAULT": f"fail_requests:{switch}"})
    engine.wait_ready()
    assert "5461" in (content_of(chat(engine, "What is 127*43?")) or "")
    switch.touch()
    status, reply = post(
        engine.url("/v1/chat/completions"),
        {"messages": [{"role": "user", "content": "What is 127*43?"}]},
    )
    assert status == 500
    assert reply["error"]["type"] == "InternalServerError"
    assert reply["error"]["message"].startswith("EngineCore encountered an issue.")
    assert get(engine.url("/health"))[0] == 200
    switch.unlink()
    assert "5461" in (content_of(chat(engine, "What is 127*43?")) or "")


def test_a_fault_once_dir_makes_a_switch_strike_the_first_engine_only(
    engines: Engines, tmp_path: Path
) -> None:
    env = {
        "STANDIN_FAULT": "die_after_ready:0.3",
        "STANDIN_DEAD_EXIT_S": "1",
        "STANDIN_FAULT_ONCE_DIR": str(tmp_path / "once"),
    }
    first = engines.start(env=env)
    first.wait_ready()
    assert first.wait_exit() == 0
    assert (tmp_path / "once" / "die_after_ready").exists()
    second = engines.start(env=env)
    second.wait_ready()
    assert "5461" in (content_of(chat(second, "What is 127*43?")) or "")
    assert get(second.url("/health"))[0] == 200


def test_unknown_fault_switch_is_refused() -> None:
    with pytest.raises(FaultSpecError, match="unknown switch 'explode'"):
        Faults.parse("explode", 0)
    with pytest.raises(FaultSpecError, match="not a fatal kind"):
        Faults.parse("fatal:meteor", 0)
    assert Faults.parse("crash@1+2,slow_boot:3", 2).active == {"crash": "", "slow_boot": "3"}
    assert Faults.parse("crash@1+2", 0).active == {}


def test_repeats_a_sentence_word_for_word() -> None:
    from lab.engine.standin_answers import answer
    from sparkdeploy.steps.smoke_test import COPY_PROMPT, COPY_SENTENCE

    assert answer(COPY_PROMPT) == COPY_SENTENCE


@pytest.mark.parametrize("where", ["flag", "env"])
def test_an_api_key_guards_v1_as_vllm_does_and_the_probes_send_it(
    engines: Engines, where: str
) -> None:
    from pydantic import SecretStr

    from sparkdeploy.remote.engine_http import probe_completion, probe_endpoint
    from sparkdeploy.steps.smoke_test import SmokeSettings, chat_stream
    from sparkdeploy.steps.smoke_test import chat as smoke_chat

    key = "k-" + where
    flags = ["--served-model-name", "tiny", "--max-model-len", "2048"]
    if where == "flag":
        # --api-key wins over VLLM_API_KEY (vllm/entrypoints/serve/middleware/register.py)
        engine = engines.start(*flags, "--api-key", key, env={"VLLM_API_KEY": "other"})
    else:
        engine = engines.start(*flags, env={"VLLM_API_KEY": key})
    engine.wait_ready()
    assert get(engine.url("/health"))[0] == 200
    assert get(engine.url("/v1/models"))[0] == 401
    assert post(engine.url("/v1/completions"), {"model": "tiny", "prompt": "Hi"})[0] == 401
    base = engine.url("")
    refused = probe_endpoint(base, "tiny", timeout=5)
    assert not refused.ready
    assert "401" in refused.detail
    assert "sets none" in refused.detail
    assert "other than" in probe_endpoint(base, "tiny", timeout=5, api_key=SecretStr("no")).detail
    assert probe_endpoint(base, "tiny", timeout=5, api_key=SecretStr(key)).ready
    assert probe_completion(base, "tiny", timeout=30, api_key=SecretStr(key)).ready
    keyless = SmokeSettings(base, "tiny", max_tokens=8)
    assert (smoke_chat(keyless, "keyless", "Hi").error or "").startswith("HTTP 401")
    keyed = SmokeSettings(base, "tiny", api_key=SecretStr(key), max_tokens=8)
    assert smoke_chat(keyed, "keyed", "Hi").error is None
    assert chat_stream(keyed, "streamed", "Hi").reply.error is None
    assert key not in engine.log()
    if where == "flag":
        assert "'api_key': '***'" in engine.log()  # vLLM 0.32's non-default args line
