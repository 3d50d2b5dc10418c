"""The fault switches (env STANDIN_FAULT) and the fatal lines vLLM prints
(docs/recipes.md#boot_markers-and-failure_markers).

STANDIN_FAULT is a comma-separated list of `name[:value][@rank[+rank...]]`; `@ranks` limits a
switch to those node ranks (e.g. `crash@2` crashes node rank 2 only). lab/engine/README.md lists
the switches. With STANDIN_FAULT_ONCE_DIR, a directory that outlives the container (a mount of
the node's), each switch strikes only the first engine started with that directory: a transient
fault, which a redeploy cures.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

try:
    from lab.engine.standin_net import engine_timeout_line, gloo_peer_closed_line
except ImportError:  # copied flat into the engine image
    from standin_net import (  # type: ignore[no-redef, import-not-found]
        engine_timeout_line,
        gloo_peer_closed_line,
    )

# Fatal kinds named like the gate's marker for the line they print (sparkdeploy/vllm/markers.py
# names the upstream file of each): what a GPU cluster prints and a CPU one cannot.
MARKER_NAMED_KINDS = (
    "nccl_error",
    "dist_backend_error",
    "dist_store_error",
    "workers_never_joined",
    "worker_proc_died",
    "rpc_timed_out",
    "engine_core_proc_died",
    "engine_core_fatal",
    "engine_dead",
    "worker_died",
)
# Where in the boot each fatal kind strikes, and what it prints.
FATAL_PHASES = {
    "free_memory": "startup",
    "dist_network": "startup",
    "cuda_oom": "load",
    "kv_cache_needed": "kv_cache",
    "no_cache_blocks": "kv_cache",
    "engine_timeout": "kv_cache",
    "engine_core_failed": "kv_cache",
    "glm_mla_stride": "kv_cache",
    "fp8_kv_fa3": "kv_cache",
    # The distributed layer's and the engine core's deaths, while the weights load.
    **dict.fromkeys(MARKER_NAMED_KINDS, "load"),
}

SWITCHES = (
    "crash",
    "fatal",
    "exit137",
    "hang",
    "slow_boot",
    "token_loop",
    "garbled",
    "empty_content",
    "bad_after",
    "typos",
    "hang_long_prompt",
    "die_after_ready",
    "fail_requests",
    "allocate",
)


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Faults:
    """The switches that apply to this node rank, with their values ('' when none)."""

    active: Mapping[str, str]

    @classmethod
    def parse(cls, spec: str, node_rank: int) -> Faults:
        active: dict[str, str] = {}
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            body, _, ranks = item.partition("@")
            name, _, value = body.partition(":")
            if name not in SWITCHES:
                raise FaultSpecError(
                    f"STANDIN_FAULT: unknown switch {name!r} in {spec!r}; known: "
                    f"{', '.join(SWITCHES)}"
                )
            if name == "fatal" and value not in FATAL_PHASES:
                raise FaultSpecError(
                    f"STANDIN_FAULT: fatal:{value} is not a fatal kind; known: "
                    f"{', '.join(FATAL_PHASES)}"
                )
            if ranks and node_rank not in {int(rank) for rank in ranks.split("+")}:
                continue
            active[name] = value
        return cls(active)

    def first_time_only(self, directory: Path) -> Faults:
        """The switches that have not struck an engine started with `directory` yet; each is
        marked there (created atomically, so two engines never both take one)."""
        directory.mkdir(parents=True, exist_ok=True)
        fresh = {}
        for name, value in self.active.items():
            try:
                os.close(os.open(directory / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue
            fresh[name] = value
        return Faults(fresh)

    def has(self, name: str) -> bool:
        return name in self.active

    def number(self, name: str, default: float) -> float:
        value = self.active.get(name, "")
        return float(value) if value else default

    def fatal_at(self, phase: str) -> str | None:
        kind = self.active.get("fatal")
        return kind if kind is not None and FATAL_PHASES[kind] == phase else None


def fatal_lines(kind: str, env: Mapping[str, str], *, master: tuple[str, int]) -> list[str]:
    """The line(s) vLLM prints for each fatal kind, figures from a GB10 at the seeds' settings."""
    timeout = float(env.get("VLLM_ENGINE_READY_TIMEOUT_S", "600"))
    lines = {
        "free_memory": [
            "ValueError: Free memory on device cuda:0 (106.61/121.63 GiB) on startup is less "
            "than desired GPU memory utilization (0.9, 109.47 GiB). Decrease GPU memory "
            "utilization or reduce GPU memory used by other processes."
        ],
        "dist_network": [
            "torch.distributed.DistNetworkError: The client socket has timed out after "
            f"600000ms while trying to connect to ({master[0]}, {master[1]})."
        ],
        "cuda_oom": [
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
            "total capacity of 121.63 GiB of which 1.12 GiB is free. Including non-PyTorch "
            "memory, this process has 118.20 GiB memory in use."
        ],
        "kv_cache_needed": [
            "ValueError: To serve at least one request with the model's max seq len (524288), "
            "(30.00 GiB KV cache is needed, which is larger than the available KV cache memory "
            "(10.00 GiB). Based on the available memory, the estimated maximum model length is "
            "174752. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
            "initializing the engine."
        ],
        "no_cache_blocks": [
            "ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine."
        ],
        "engine_timeout": [engine_timeout_line(timeout)],
        "engine_core_failed": [],
        "glm_mla_stride": [
            "ValueError: GLM MLA parent-page stride must be an exact number of C4 pages"
        ],
        "fp8_kv_fa3": ["ValueError: FP8 KV cache requires FA3 on SM90 or FA4 on SM100"],
        "nccl_error": [
            "torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/"
            "c10d/ProcessGroupNCCL.cpp:3356, unhandled system error (run with NCCL_DEBUG=INFO "
            "for details), NCCL version 2.27.3"
        ],
        "dist_backend_error": [
            "torch.distributed.DistBackendError: [Rank 1] Process group watchdog thread "
            "terminated with exception: [Rank 1] Watchdog caught collective operation timeout"
        ],
        "dist_store_error": [
            "torch.distributed.DistStoreError: wait timeout after 300000ms, keys: "
            "/default_pg//cpu//0"
        ],
        "workers_never_joined": [
            "torch.distributed.DistStoreError: Timed out after 1801 seconds waiting for clients."
            " 1/2 clients joined."
        ],
        "worker_proc_died": [
            "Worker proc Worker_TP1 died unexpectedly (exit code: -9), shutting down executor."
        ],
        "rpc_timed_out": ["TimeoutError: RPC call to execute_model timed out."],
        "engine_core_proc_died": [
            "RuntimeError: Engine core process EngineCore_DP0 died unexpectedly."
        ],
        "engine_core_fatal": ["EngineCore encountered a fatal error."],
        "engine_dead": [
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See "
            "stack trace (above) for the root cause."
        ],
        "worker_died": [gloo_peer_closed_line(master[0], 1)],
    }
    return lines[kind]
