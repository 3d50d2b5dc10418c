"""What vLLM prints while it boots and when it dies, as named regexes (FACTS.md, vLLM 0.11-0.34).

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

# The head's boot, in the order vLLM prints it. The KV cache size and the maximum concurrency
# are one line from 0.33 on and two lines in 0.11; one line may satisfy several markers.
DEFAULT_BOOT_MARKERS: tuple[Marker, ...] = (
    Marker("weights_loaded", rf"Loading weights took (?P<weights_load_s>{_NUMBER}) s"),
    Marker(
        "model_loaded",
        rf"Model loading took (?P<model_load_gib>{_NUMBER}) GiB(?: memory)?"
        rf"(?: and (?P<model_load_s>{_NUMBER}) s)?",
    ),
    Marker("kv_cache_memory", rf"Available KV cache memory: (?P<kv_cache_gib>{_NUMBER}) GiB"),
    Marker("kv_cache_size", rf"GPU KV cache size: (?P<kv_cache_tokens>{_NUMBER}) tokens"),
    Marker(
        "max_concurrency",
        rf"Maximum concurrency for (?P<max_concurrency_request_tokens>{_NUMBER}) tokens per "
        rf"request: (?P<max_concurrency>{_NUMBER})x",
    ),
    Marker(
        "engine_initialized",
        rf"init engine \(profile, create kv cache, warmup model\) took (?P<init_engine_s>{_NUMBER})"
        r" s",
    ),
    # 0.33+: "Starting vLLM server on http://..."; 0.11: "Starting vLLM API server 0 on http://..."
    Marker("api_server_starting", r"Starting vLLM (?:API )?server (?:\d+ )?on "),
    Marker("uvicorn_started", r"Started server process \["),
    Marker("application_startup", r"Waiting for application startup\."),
    Marker("application_ready", r"Application startup complete\."),
)

# A worker of the mp backend (`--headless`) has joined the head once it prints this.
HEADLESS_WORKER_JOINED = Marker(
    "headless_worker_joined", r"Launching vLLM \(v?[^)]*\) headless multiproc executor"
)

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
)

# The failure marker whose line only points at the real cause, printed earlier in the log.
ROOT_CAUSE_ABOVE = "engine_core_init_failed"

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
    "container_exited": "read the quoted lines; the full log is in the deployment's run dir",
    "timeout": (
        "raise the recipe's readiness timeout if the engine is just slow; otherwise the quoted "
        "lines show where it stopped"
    ),
    "served_name_mismatch": "set --served-model-name in the recipe to the name the plan expects",
}
