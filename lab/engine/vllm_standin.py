"""`vllm serve` as the pipeline sees it, without a GPU: the lab's engine stand-in.

Run as `python3 vllm_standin.py serve MODEL [vLLM flags]` (the image's `vllm` wrapper does so).
It parses vLLM's flags, checks the node's network settings, meets the other nodes over a real TCP
rendezvous, resolves and reads the model offline, verifies this node's Engram rows, prints
vLLM's log lines in vLLM's order and serves the OpenAI-compatible API. Fault switches (env
STANDIN_FAULT) make it fail the ways the field does; see lab/engine/README.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

try:
    from lab.engine import standin_model as model_io
    from lab.engine.standin_api import StandinServer
    from lab.engine.standin_args import non_default_args, parse_command_line
    from lab.engine.standin_faults import Faults, FaultSpecError, fatal_lines
    from lab.engine.standin_images import image_limit
    from lab.engine.standin_log import VLLM_VERSION, EngineFatal, Logger
    from lab.engine.standin_net import (
        HeadRendezvous,
        WorkerRendezvous,
        check_node_network,
        gloo_peer_closed_line,
        headless_line,
    )
    from lab.engine.standin_parallel import ParallelLayout
    from lab.engine.standin_state import EngineState, OutputFaults, ServingConfig
except ImportError:  # copied flat into the engine image
    import standin_model as model_io  # type: ignore[no-redef, import-not-found]
    from standin_api import StandinServer  # type: ignore[no-redef, import-not-found]
    from standin_args import non_default_args, parse_command_line  # type: ignore[no-redef, import-not-found]
    from standin_faults import Faults, FaultSpecError, fatal_lines  # type: ignore[no-redef, import-not-found]
    from standin_images import image_limit  # type: ignore[no-redef, import-not-found]
    from standin_log import VLLM_VERSION, EngineFatal, Logger  # type: ignore[no-redef, import-not-found]
    from standin_net import (  # type: ignore[no-redef, import-not-found]
        HeadRendezvous,
        WorkerRendezvous,
        check_node_network,
        gloo_peer_closed_line,
        headless_line,
    )
    from standin_parallel import ParallelLayout  # type: ignore[no-redef, import-not-found]
    from standin_state import (  # type: ignore[no-redef, import-not-found]
        EngineState,
        OutputFaults,
        ServingConfig,
    )

DEFAULT_MASTER_PORT = 29501
DEFAULT_RENDEZVOUS_TIMEOUT_S = 30.0
DEFAULT_ENGINE_READY_TIMEOUT_S = 600.0
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class Shutdown(Exception):
    """SIGTERM or SIGINT: stop as vLLM does, telling the workers first."""


def _raise_shutdown(signum: int, frame: FrameType | None) -> None:
    raise Shutdown(signal.Signals(signum).name)


class StandinEngine:
    """One node's `vllm serve`: the head (node rank 0, with the API) or a headless worker."""

    def __init__(self, args: argparse.Namespace, env: Mapping[str, str]) -> None:
        self.args = args
        self.env = env
        self.started = time.monotonic()
        self.layout = ParallelLayout.from_args(args)
        self.headless = bool(args.headless)
        self.master = (args.master_addr or "127.0.0.1", args.master_port or DEFAULT_MASTER_PORT)
        # vLLM 0.32's process names: APIServer, EngineCore, and a worker process per rank that
        # is "Worker" until its rank is assigned, then "Worker_TPr" when there are several.
        self.api = Logger("APIServer")
        self.core = Logger("EngineCore")
        self.uvicorn = Logger("")
        self.ready_timeout_s = float(
            env.get("VLLM_ENGINE_READY_TIMEOUT_S", DEFAULT_ENGINE_READY_TIMEOUT_S)
        )
        self.faults = Faults.parse(env.get("STANDIN_FAULT", ""), self.layout.node_rank)
        if env.get("STANDIN_FAULT_ONCE_DIR"):
            self.faults = self.faults.first_time_only(Path(env["STANDIN_FAULT_ONCE_DIR"]))
        self.head: HeadRendezvous | None = None
        self.worker: WorkerRendezvous | None = None
        self.server: StandinServer | None = None
        self.state: EngineState | None = None
        self.exit_code: int | None = None
        # What the `allocate` switch holds on to until the engine exits.
        self.allocated = b""
        self.stopped = threading.Event()

    # -- the boot, in vLLM's order ------------------------------------------------------------

    def run(self) -> int:
        previous = {
            signum: signal.signal(signum, _raise_shutdown)
            for signum in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            self.boot()
            return self.serve()
        except EngineFatal as fatal:
            return self.fail(fatal)
        except Shutdown as stop:
            self.api.info("launcher.py:110", f"Shutting down ({stop}).")
            return 0
        except Exception:
            self.core.error("core.py:843", "EngineCore failed to start.")
            for line in traceback.format_exc().splitlines():
                self.core.raw(line)
            if self.worker is not None:
                self.worker.report_failed("crashed while loading (traceback in its log)")
            if not self.headless:
                self.api.raw(_engine_core_failed())
            return 1
        finally:
            self.close()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def boot(self) -> None:
        if self.headless:
            self.core = Logger("MainProcess")
        else:
            self.api.info("api_utils.py:347", f"vLLM API server version {VLLM_VERSION}")
            self.api.info("api_utils.py:286", f"non-default args: {non_default_args(self.args)}")
        self.layout.check(self.args.distributed_executor_backend, self.headless)
        check_node_network(self.env)
        if self.headless:
            # printed at start-up, long before this node has joined the head (vLLM 0.32)
            self.core.info("serve.py:224", headless_line(*self.master))
        else:
            self.server = self.bind_api_port()
            self.core.info(
                "core.py:133",
                f"Initializing a V1 LLM engine (v{VLLM_VERSION}) with config: "
                f"model={self.args.model!r}, tensor_parallel_size={self.layout.tp}, "
                f"pipeline_parallel_size={self.layout.pp}",
            )
        self.strike("startup")
        memory = model_io.DeviceMemory.from_env(self.env)
        memory.check_utilization(self.utilization)
        self.rendezvous()
        model = self.load()
        if self.worker is not None:
            self.worker.report_loaded()
            return
        if self.head is not None:
            self.head.wait_all_loaded(self.started + self.ready_timeout_s, self.ready_timeout_s)
        self.start_api(self.init_kv_cache(model, memory))

    @property
    def utilization(self) -> float:
        value = self.args.gpu_memory_utilization
        return 0.9 if value is None else float(value)

    def bind_api_port(self) -> StandinServer:
        host = self.args.host or "0.0.0.0"
        port = 8000 if self.args.port is None else self.args.port
        try:
            return StandinServer((host, port))
        except OSError as exc:
            raise EngineFatal(
                [
                    f"ERROR: [Errno {exc.errno}] error while attempting to bind on address "
                    f"({host!r}, {port}): {(exc.strerror or str(exc)).lower()}"
                ],
                engine_core=False,
            ) from exc

    def strike(self, phase: str) -> None:
        """Apply a `fatal:<kind>` switch that strikes at this phase of the boot."""
        kind = self.faults.fatal_at(phase)
        if kind is not None:
            lines = fatal_lines(kind, self.env, master=self.master)
            raise EngineFatal(lines, engine_core=kind != "engine_timeout")

    def rendezvous(self) -> None:
        addr, port = self.master
        layout = self.layout
        unassigned = Logger("Worker")
        if layout.nnodes == 1:
            for rank in layout.local_ranks():
                layout.print_process_group(unassigned, rank, "127.0.0.1", port)
            layout.print_rank_assignments(unassigned)
            return
        hello = {
            "node_rank": layout.node_rank,
            "nnodes": layout.nnodes,
            "tensor_parallel_size": layout.tp,
            "pipeline_parallel_size": layout.pp,
            "model": self.args.model,
        }
        if layout.node_rank == 0:
            self.head = HeadRendezvous(
                addr,
                port,
                layout.nnodes,
                {key: value for key, value in hello.items() if key != "node_rank"},
                self.core,
                on_worker_lost=self.worker_lost,
            )
            self.head.start()
            for rank in layout.local_ranks():
                layout.print_process_group(unassigned, rank, addr, port)
            # vLLM's head waits here, silent, until every worker has connected.
            self.head.wait_all_joined(self.started + self.ready_timeout_s, self.ready_timeout_s)
        else:
            for rank in layout.local_ranks():
                layout.print_process_group(unassigned, rank, addr, port)
            timeout = float(self.env.get("VLLM_RENDEZVOUS_TIMEOUT_S", DEFAULT_RENDEZVOUS_TIMEOUT_S))
            self.worker = WorkerRendezvous.connect(addr, port, timeout, hello)
        layout.print_rank_assignments(unassigned)

    def load(self) -> model_io.LoadedModel:
        load_started = time.monotonic()
        if self.faults.has("slow_boot"):
            self.sleep_within_ready_timeout(self.faults.number("slow_boot", 5.0))
        if self.faults.has("hang"):
            while True:
                time.sleep(3600)
        if self.faults.has("crash"):
            raise RuntimeError("STANDIN_FAULT=crash: the engine stand-in crashed loading weights")
        if self.faults.has("exit137"):
            _kill_self()
        if self.faults.has("allocate"):
            # Every page written, so the kernel charges it: weights bigger than the memory.
            self.allocated = b"\x01" * (int(self.faults.number("allocate", 256)) << 20)
        self.strike("load")
        model = model_io.load_model(self.args.model, self.args.revision, self.env)
        tp = self.layout.tp
        tp_ranks = sorted({rank % tp for rank in self.layout.local_ranks()})
        for checked in model_io.verify_engram_rows(model, tp_ranks, tp):
            self.core.info("engram_loader.py:88", f"Engram table verified: {checked}")
        elapsed = time.monotonic() - load_started
        weights_gib = model.dense_bytes() / tp / model_io.GIB
        for rank in self.layout.local_ranks():
            worker = self.layout.worker_log(rank)
            worker.info("default_loader.py:501", f"Loading weights took {elapsed:.2f} seconds")
            worker.info(
                "gpu_model_runner.py:5150",
                f"Model loading took {weights_gib:.4f} GiB memory and {elapsed:.6f} seconds",
            )
        algo = self.env.get("STANDIN_QUANTPROBE")
        if algo is not None:
            self.core.info(
                "quantprobe.py:41",
                f"[quantprobe] layer=model.layers.45.mlp.experts scheme=mtp algo={algo}",
            )
        return model

    def sleep_within_ready_timeout(self, seconds: float) -> None:
        remaining = self.started + self.ready_timeout_s - time.monotonic()
        time.sleep(max(0.0, min(seconds, remaining)))
        if seconds > remaining:
            self.strike_timeout()

    def strike_timeout(self) -> None:
        raise EngineFatal(
            fatal_lines("engine_timeout", self.env, master=self.master), engine_core=False
        )

    def init_kv_cache(
        self, model: model_io.LoadedModel, memory: model_io.DeviceMemory
    ) -> model_io.KvCachePlan:
        self.strike("kv_cache")
        plan = model_io.plan_kv_cache(
            model,
            memory,
            tp=self.layout.tp,
            utilization=self.utilization,
            kv_cache_memory_bytes=self.args.kv_cache_memory_bytes,
            max_model_len=self.args.max_model_len,
            block_size=self.args.block_size or 16,
            kv_cache_dtype=self.args.kv_cache_dtype,
        )
        self.layout.worker_log(0).info(
            "gpu_worker.py:760", f"Available KV cache memory: {plan.available_gib:.2f} GiB"
        )
        self.core.info(
            "kv_cache_utils.py:2327",
            f"GPU KV cache size: {plan.tokens:,} tokens, Maximum concurrency for "
            f"{plan.max_model_len:,} tokens per request: {plan.concurrency:.2f}x",
        )
        self.core.info(
            "core.py:402",
            "init engine (profile, create kv cache, warmup model) took "
            f"{time.monotonic() - self.started:.2f} s",
        )
        return plan

    def start_api(self, plan: model_io.KvCachePlan) -> None:
        assert self.server is not None
        args = self.args
        served = tuple(args.served_model_name or [args.model])
        config = ServingConfig(
            served_names=served,
            model=args.model,
            max_model_len=plan.max_model_len,
            reasoning_parser=args.reasoning_parser,
            tool_call_parser=args.tool_call_parser,
            auto_tool_choice=bool(args.enable_auto_tool_choice),
            # --api-key wins over VLLM_API_KEY, as in vLLM 0.32
            # (vllm/entrypoints/serve/middleware/register.py)
            api_keys=tuple(key for key in (args.api_key or [self.env.get("VLLM_API_KEY")]) if key),
            block_size=args.block_size or 16,
            kv_cache_tokens=plan.tokens,
            token_delay_s=float(self.env.get("STANDIN_DECODE_DELAY_S", "0.001")),
            prefix_caching=args.enable_prefix_caching is not False,
            image_limit=image_limit(args.limit_mm_per_prompt),
        )
        faults = OutputFaults(
            token_loop=self.faults.has("token_loop"),
            garbled=self.faults.has("garbled"),
            empty_content=self.faults.has("empty_content"),
            bad_after=(
                int(self.faults.number("bad_after", 5)) if self.faults.has("bad_after") else None
            ),
            typos=self.faults.number("typos", 0.05) if self.faults.has("typos") else None,
            hang_long_prompt=self.faults.has("hang_long_prompt"),
            fail_requests_when=self.faults.active.get("fail_requests") or None,
        )
        self.state = EngineState(config, faults)
        host, port = self.server.server_name, self.server.server_port
        self.api.info("entry.py:140", f"Starting vLLM server on http://{host}:{port}")
        self.api.info("launcher.py:186", "Available routes are:")
        for route, methods in (
            ("/health", "GET"),
            ("/v1/models", "GET"),
            ("/version", "GET"),
            ("/load", "GET"),
            ("/metrics", "GET"),
            ("/v1/chat/completions", "POST"),
            ("/v1/completions", "POST"),
        ):
            self.api.info("launcher.py:195", f"Route: {route}, Methods: {methods}")
        self.server.start_listening(self.state)
        # uvicorn's own lines carry no process prefix
        self.uvicorn.raw(f"INFO:     Started server process [{os.getpid()}]")
        self.uvicorn.raw("INFO:     Waiting for application startup.")
        self.uvicorn.raw("INFO:     Application startup complete.")

    # -- after the boot -----------------------------------------------------------------------

    def serve(self) -> int:
        if self.worker is not None:
            return self.serve_as_worker(self.worker)
        if self.faults.has("die_after_ready"):
            delay = self.faults.number("die_after_ready", 0.5)
            threading.Timer(
                delay, self.engine_died, args=("STANDIN_FAULT=die_after_ready",)
            ).start()
        while not self.stopped.wait(0.5):
            pass
        return self.exit_code or 0

    def serve_as_worker(self, worker: WorkerRendezvous) -> int:
        """Stay up while the head lives; exit 0 when it shuts down, 1 when it vanishes."""
        while True:
            try:
                status = worker.next_status()
            except TimeoutError:
                self.core.error("multiproc_executor.py:655", "WorkerProc hit an exception.")
                self.core.raw("RuntimeError: STANDIN_FAULT=die_after_ready: the worker died")
                return 1
            if status == "ready":
                self.core.info("multiproc_executor.py:520", "the head's engine is ready")
                if self.faults.has("die_after_ready"):
                    worker.sock.settimeout(self.faults.number("die_after_ready", 0.5))
                continue
            if status == "shutdown":
                self.core.info("multiproc_executor.py:610", "the head shut down; exiting")
                return 0
            self.core.error(
                "multiproc_executor.py:640",
                f"the connection to the head at {worker.addr}:{worker.port} was lost; exiting",
            )
            return 1

    def worker_lost(self, node_rank: int, host: str) -> None:
        # vLLM 0.32: TP rank 0's gloo pair reports the peer, then the engine core dies.
        worker = self.layout.worker_log(0)
        worker.error("multiproc_executor.py:1063", "WorkerProc hit an exception.")
        worker.error("multiproc_executor.py:1063", gloo_peer_closed_line(host, node_rank))
        self.engine_died(f"the worker on node rank {node_rank} ({host}) is gone")

    def engine_died(self, cause: str) -> None:
        """The engine core is dead: /health answers 503, then the server exits with status 0
        (vLLM's way: its API server finishes normally once the engine is gone)."""
        if self.state is not None:
            self.state.dead = True
        self.core.error("core.py:1512", "EngineCore encountered a fatal error.")
        self.core.error("core.py:1512", f"RuntimeError: {cause}")
        self.api.error("async_llm.py:906", "AsyncLLM output_handler failed.")
        self.api.error(
            "async_llm.py:906", f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD}"
        )
        grace = float(self.env.get("STANDIN_DEAD_EXIT_S", "1.0"))
        threading.Timer(grace, self.stop, args=(0,)).start()

    def stop(self, code: int) -> None:
        self.exit_code = code
        self.uvicorn.raw(f"INFO:     Finished server process [{os.getpid()}]")
        self.stopped.set()

    def fail(self, fatal: EngineFatal) -> int:
        logger = self.core if fatal.engine_core else self.api
        if self.headless:
            logger = self.core
        if fatal.engine_core:
            logger.error("core.py:843", "EngineCore failed to start.")
        for line in fatal.lines:
            logger.raw(line)
        if self.worker is not None:
            self.worker.report_failed(fatal.lines[-1] if fatal.lines else "failed")
        if fatal.engine_core and not self.headless:
            self.api.raw(_engine_core_failed())
        return 1

    def close(self) -> None:
        if self.head is not None:
            self.head.close()
        if self.worker is not None:
            self.worker.close()
        if self.server is not None:
            self.server.server_close()


def _engine_core_failed() -> str:
    return (
        "RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {'EngineCore_DP0': 1}"
    )


def _kill_self() -> None:
    """Die as the kernel's OOM killer would make us: SIGKILL, exit code 137."""
    sys.stdout.flush()
    if os.getpid() == 1:
        # PID 1 of a container cannot be signalled from inside; its exit code is what counts.
        os._exit(137)
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(sys.argv[1:] if argv is None else argv)
    try:
        engine = StandinEngine(args, os.environ)
    except FaultSpecError as exc:
        print(f"vllm serve: {exc}", file=sys.stderr)
        return 2
    return engine.run()


if __name__ == "__main__":
    sys.exit(main())
