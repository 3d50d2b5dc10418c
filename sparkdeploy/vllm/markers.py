"""What vLLM prints while it boots and when it dies, as named regexes (vLLM 0.11-0.34).

Named groups in a pattern are the figures the boot timeline reports; their values are numbers
(thousands separators allowed). Recipes may replace the boot markers and add failure markers; a
recipe's markers are any objects with `name` and `pattern` (plan.MarkerSpec included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class MarkerLike(Protocol):
    """A named regex: plan.MarkerSpec and Marker both qualify."""

    @property
    def name(self) -> str: ...

    @property
    def pattern(self) -> str: ...


@dataclass(frozen=True)
class Marker:
    name: str
    pattern: str


_NUMBER = r"[\d][\d,]*(?:\.\d+)?"

# The head's boot: the lines every supported vLLM version (0.11-0.34) prints on every platform
# (GPU and CPU builds), in the order it prints them. The gate waits for each. Checked against
# the vLLM source (vllm-project/vllm) and real 0.32.0 CPU logs (tests/fixtures/vllm-0.32-cpu);
# docs/recipes.md lists the source file of each line.
DEFAULT_BOOT_MARKERS: tuple[Marker, ...] = (
    # vllm/model_executor/model_loader/default_loader.py (the worker of TP rank 0)
    Marker("weights_loaded", rf"Loading weights took (?P<weights_load_s>{_NUMBER}) s"),
    # vllm/v1/engine/core.py: "... took 4.20 s" (0.32), "... took 48.66 seconds" (0.11)
    Marker(
        "engine_initialized",
        rf"init engine \(profile, create kv cache, warmup model\) took (?P<init_engine_s>{_NUMBER})"
        r" s",
    ),
    # 0.32+: "Starting vLLM server on http://..." (vllm/entrypoints/launchers/api_server/
    # entry.py); 0.11: "Starting vLLM API server 0 on http://..." (entrypoints/openai/api_server.py)
    Marker("api_server_starting", r"Starting vLLM (?:API )?server (?:\d+ )?on "),
    # uvicorn's own lines (uvicorn/server.py, uvicorn/lifespan/on.py)
    Marker("uvicorn_started", r"Started server process \["),
    Marker("application_startup", r"Waiting for application startup\."),
    Marker("application_ready", r"Application startup complete\."),
)

# Lines of the head that only some versions or platforms print: recorded in the timeline (their
# figures in the head's figures) when seen, never waited for. Also recorded when a recipe gives
# its own boot_markers, unless one of those has the same name.
DEFAULT_RECORDED_MARKERS: tuple[Marker, ...] = (
    # GPU only (vllm/v1/worker/gpu_model_runner.py); "Model loading took X GiB and Y seconds"
    # before 0.11.1, "X GiB memory and Y seconds" from 0.11.1 on; the CPU build prints none.
    Marker(
        "model_loaded",
        rf"Model loading took (?P<model_load_gib>{_NUMBER}) GiB(?: memory)?"
        rf"(?: and (?P<model_load_s>{_NUMBER}) s)?",
    ),
    # GPU only (vllm/v1/worker/gpu_worker.py)
    Marker("kv_cache_memory", rf"Available KV cache memory: (?P<kv_cache_gib>{_NUMBER}) GiB"),
    # vllm/v1/core/kv_cache_utils.py: "GPU KV cache size: ..." on GPUs, "CPU KV cache size: ..."
    # on the CPU build (0.32); the maximum concurrency is on the same line from 0.33 (and on
    # 0.32 CPU), on the next line in 0.11. One line may satisfy several markers.
    Marker(
        "kv_cache_size",
        rf"(?:GPU|CPU|XPU|TPU) KV cache size: (?P<kv_cache_tokens>{_NUMBER}) tokens",
    ),
    Marker(
        "max_concurrency",
        rf"Maximum concurrency for (?P<max_concurrency_request_tokens>{_NUMBER}) tokens per "
        rf"request: (?P<max_concurrency>{_NUMBER})x",
    ),
)

# A worker of the mp backend (`--headless`) has joined the head's process group once it prints
# its rank assignment (vllm/distributed/parallel_state.py; "PCP rank" from 0.12 on). The head's
# own TP rank 0 prints the same line with rank 0.
HEADLESS_WORKER_JOINED = Marker(
    "headless_worker_joined",
    r"rank (?P<rank>\d+) in world size (?P<world_size>\d+) is assigned as .*TP rank",
)

# Printed by a headless worker at start-up (vllm/entrypoints/cli/serve.py), long before it has
# joined (it then waits for the head's TCP store): recorded, never waited for.
HEADLESS_WORKER_LAUNCHING = Marker(
    "headless_worker_launching", r"Launching vLLM \(v?[^)]*\) headless multiproc executor"
)

WORKER_RECORDED_MARKERS: tuple[Marker, ...] = (HEADLESS_WORKER_LAUNCHING,)

# Lines that end a boot for good. Order matters only for a line matching several patterns.
DEFAULT_FAILURE_MARKERS: tuple[Marker, ...] = (
    Marker(
        "free_memory_below_utilization",
        r"Free memory on device \S+ \(.*\) on startup is less than desired GPU memory "
        r"utilization",
    ),
    Marker(
        "kv_cache_too_small_for_max_len",
        r"To serve at least one request with the model's max seq len \(\d+\).*is larger than "
        r"the available KV cache memory",
    ),
    Marker("no_kv_cache_memory", r"No available memory for the cache blocks"),
    Marker("cuda_out_of_memory", r"OutOfMemoryError: CUDA out of memory"),
    Marker("distributed_connect_timeout", r"DistNetworkError:.*timed out.*trying to connect to"),
    Marker(
        "engine_ready_timeout",
        r"TimeoutError: Timed out waiting for engine core processes to start",
    ),
    Marker("engine_core_init_failed", r"RuntimeError: Engine core initialization failed"),
    # argparse (vllm/entrypoints/cli/main.py's parser), after `usage: vllm [-h] [-v] ...`; exit 2
    Marker("unrecognized_arguments", r"^vllm(?: serve)?: error: unrecognized arguments: "),
    Marker("bad_command_line", r"^vllm(?: serve)?: error: "),
    # pydantic's ValidationError of ModelConfig (vllm/config/model.py); exit 1
    Marker(
        "max_model_len_too_long",
        r"User-specified max_model_len \(\d+\) is greater than the derived max_model_len",
    ),
    # huggingface_hub under HF_HUB_OFFLINE=1: a repo id not in the cache; a path that is neither
    # a directory nor a repo id
    Marker("model_not_in_offline_cache", r"LocalEntryNotFoundError: "),
    Marker("model_path_invalid", r"HFValidationError: Repo id must be in the form"),
    # The head's TP rank 0 when a worker's process dies (gloo, torch's pair.cc); the head then
    # prints "EngineCore encountered a fatal error.", EngineDeadError, and exits with status 0.
    Marker(
        "worker_died",
        r"Connection closed by peer \[(?P<peer_ip>[^\]]+)\]:\d+\. This is typically caused by "
        r"a remote worker crashing",
    ),
    # The head's torch TCP store when workers never connect (torch's default_pg_timeout, 30 min
    # for gloo unless --distributed-timeout-seconds): read from torch's source, not yet seen.
    Marker(
        "workers_never_joined",
        r"Timed out after \d+ seconds waiting for clients\. \d+/\d+ clients joined",
    ),
    # The distributed layer. Each pattern starts at the exception's class or a word of the message,
    # so a traceback's quoted source line (`raise RuntimeError(f"NCCL error: ...")`) is no match.
    # torch/csrc/distributed/c10d/NCCLUtils.hpp: "NCCL error in: FILE:LINE, <error>, NCCL version
    # X" raised as torch.distributed.DistBackendError; vllm/distributed/device_communicators/
    # pynccl_wrapper.py: RuntimeError "NCCL error: <error>". Before dist_backend_error: a line
    # of both is named by what failed.
    Marker("nccl_error", r"Error: NCCL error(?: in)?: "),
    # torch/distributed/__init__.py (torch._C._DistBackendError): any other collective backend
    # failure (ProcessGroupNCCL's watchdog, gloo).
    Marker("dist_backend_error", r"DistBackendError: "),
    # torch/csrc/distributed/c10d/TCPStore.cpp ("wait timeout after Nms, keys: ...") and
    # torch/distributed/distributed_c10d.py ("Timed out initializing process group in store
    # based barrier"): the c10d store gloo and NCCL rendezvous through. After
    # workers_never_joined, which is a DistStoreError too and says more.
    Marker("dist_store_error", r"DistStoreError: "),
    # vllm/v1/executor/multiproc_executor.py, the executor's worker monitor: a TP/PP worker
    # process of this node is gone ("Worker proc Worker_TP1 died unexpectedly (exit code: -9),
    # shutting down executor.").
    Marker("worker_proc_died", r"Worker proc \S+ died unexpectedly \(exit code: "),
    # vllm/v1/executor/multiproc_executor.py: a worker did not answer a collective RPC in time
    # (TimeoutError "RPC call to <method> timed out."; <method> may be a repr with spaces).
    Marker("rpc_timed_out", r"TimeoutError: RPC call to .+ timed out\."),
    # vllm/v1/utils.py, the API server's watch of its engine cores ("Engine core process
    # EngineCore_DP0 died unexpectedly."), also quoted in "Exception occurred while running API
    # servers: ...".
    Marker("engine_core_proc_died", r"Engine core process \S+ died unexpectedly"),
    # vllm/v1/engine/core.py and the API server's AsyncLLM: the engine died, the cause is above.
    Marker("engine_core_fatal", r"EngineCore encountered a fatal error"),
    Marker("engine_dead", r"EngineDeadError: "),
)

# The failure markers whose line only points at the real cause, printed earlier in the log.
ROOT_CAUSE_ABOVE: frozenset[str] = frozenset(
    {
        "engine_core_init_failed",
        "engine_core_fatal",
        "engine_dead",
        "worker_proc_died",
        "engine_core_proc_died",
    }
)

# vLLM's own line for a deliberate stop (SIGTERM); the lines after it are its teardown, where
# EngineDeadError is printed too, and are not a failure.
SHUTDOWN_TRIGGERED = r"\[shutdown\] API server: shutdown triggered"

# What the operator should do about each failure, by marker name or failure kind.
FAILURE_HINTS: dict[str, str] = {
    "free_memory_below_utilization": (
        "free memory on the node (stop other GPU users, drop the page cache: the cluster's "
        "docker.drop_page_cache) or lower --gpu-memory-utilization in the recipe"
    ),
    "kv_cache_too_small_for_max_len": (
        "lower --max-model-len or give the KV cache more memory (--gpu-memory-utilization or "
        "--kv-cache-memory-bytes) in the recipe"
    ),
    "no_kv_cache_memory": (
        "the weights leave no memory for the KV cache: raise --gpu-memory-utilization or use "
        "more nodes (a higher tensor-parallel size)"
    ),
    "cuda_out_of_memory": (
        "lower --max-num-batched-tokens/--max-num-seqs or --gpu-memory-utilization, or use "
        "more nodes"
    ),
    "distributed_connect_timeout": (
        "a node cannot reach the head's master port over the fabric: check fabric_ip, "
        "NCCL/GLOO_SOCKET_IFNAME and that no old container still holds the port"
    ),
    "engine_ready_timeout": (
        "the engine processes did not start in VLLM_ENGINE_READY_TIMEOUT_S: look for a stuck "
        "worker (a worker that met an old head) or raise the timeout for slow loads"
    ),
    "engine_core_init_failed": (
        "fix the root cause: the first error in the log lines above, not the final RuntimeError"
    ),
    "container_missing": (
        "run the boot step first; if it ran, its log says why this container was not started "
        "(or what removed it)"
    ),
    "oom_killed": (
        "the kernel OOM-killed the container: drop the page cache before boot "
        "(docker.drop_page_cache), cap JIT parallelism (MAX_JOBS) or lower memory use"
    ),
    "killed": (
        "something outside the engine killed it: look for a `docker kill`/`docker stop` or a"
        " teardown on the node at that time (a lost Prefect worker's cleanup, a person, another"
        " deploy); if State.OOMKilled was unknown, check `dmesg` for the OOM killer"
    ),
    "container_exited": "read the quoted lines; the full log is in the deployment's run dir",
    "timeout": (
        "raise the recipe's readiness timeout if the engine is just slow; otherwise the quoted "
        "lines show where it stopped"
    ),
    "served_name_mismatch": "set --served-model-name in the recipe to the name the plan expects",
    "unrecognized_arguments": (
        "remove or fix the flag in the recipe's args: this vLLM version does not know it "
        "(`vllm serve --help` in the image lists the flags it has)"
    ),
    "bad_command_line": "fix the recipe's args: vLLM's argparse refused them (quoted above)",
    "max_model_len_too_long": (
        "lower --max-model-len to the model's max_position_embeddings, or set "
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in the recipe's env if the model really supports more"
    ),
    "model_not_in_offline_cache": (
        "the model is not in the node's HF cache and the hub is offline: run the prefetch step, "
        "and check the recipe's model repo id and revision"
    ),
    "model_path_invalid": (
        "the model argument is neither a directory in the container nor a repo id: check the "
        "recipe's model and its mounts"
    ),
    "head_exited": (
        "the head's container stopped without a teardown: its log above says why; real vLLM "
        "exits with status 0 after its engine died, so a 0 is no clean stop either"
    ),
    "worker_died": (
        "a worker's engine process died: read that worker's container log (docker logs, the "
        "run dir) for why (OOM kill, crash, stopped), then redeploy"
    ),
    "worker_never_joined": (
        "the worker's engine never reached the head's process group: check that its container "
        "runs, its --master-addr/--master-port (the head's fabric_ip), GLOO/NCCL_SOCKET_IFNAME "
        "and that the fabric lets it reach the head"
    ),
    "workers_never_joined": (
        "the head waited for workers that never came: check every worker container, their "
        "--master-addr and the fabric; raise --distributed-timeout-seconds only for slow starts"
    ),
    "nccl_error": (
        "NCCL failed between ranks: check the fabric (RoCE links up, the nodes' roce_hcas and "
        "gid_index, NCCL_SOCKET_IFNAME), rerun with NCCL_DEBUG=INFO in the recipe's env to see "
        "which rank and transport failed, then redeploy"
    ),
    "dist_backend_error": (
        "a collective (NCCL or gloo) failed or timed out between ranks: read the quoted error; "
        "a rank that died or hung first (its container log) is the usual cause, else the fabric"
    ),
    "dist_store_error": (
        "the ranks could not meet in torch's c10d store on the head's master port: check that "
        "every worker container runs and reaches the head's fabric_ip:29501 (GLOO_SOCKET_IFNAME, "
        "firewall), and that no old container holds the port; then redeploy"
    ),
    "worker_proc_died": (
        "a worker process of this engine died (exit code in the line; -9 is a SIGKILL, often "
        "the OOM killer): its error is quoted above if it printed one, else check `dmesg` for "
        "the OOM killer and lower memory use"
    ),
    "rpc_timed_out": (
        "a worker did not answer the engine in time: it hung or died; read the workers' logs "
        "(every node's container) for the first error; raise VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS "
        "(recipe env) only for a slow but healthy step"
    ),
    "engine_core_proc_died": (
        "the engine core process died: its root cause is quoted above (an OOM kill leaves "
        "none: check `dmesg`); redeploy once it is fixed"
    ),
    "engine_core_fatal": (
        "the engine core died after it started: the root cause is quoted above the final error"
    ),
    "engine_dead": (
        "the engine core died: the root cause is quoted above; redeploy once it is fixed"
    ),
    "completion_failed": (
        "the engine is up but could not answer one token: read the head's log for the error "
        "(a worker that died, an unsupported model shape on this platform)"
    ),
}
