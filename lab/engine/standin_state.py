"""The serving engine's state: what it serves with (ServingConfig), the output faults it shows,
its counters, latency histograms and prefix cache, and the /metrics page they make, as vLLM's."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

# vLLM 0.32's default buckets (vllm/v1/metrics/loggers.py, histogram_buckets; as a real engine
# exports them in tests/fixtures/vllm-0.32-cpu/metrics.txt).
TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5)
TTFT_BUCKETS += (0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)
ITL_BUCKETS += (0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0)
E2E_BUCKETS += (30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class ServingConfig:
    served_names: tuple[str, ...]
    model: str
    max_model_len: int
    reasoning_parser: str | None
    tool_call_parser: str | None
    auto_tool_choice: bool
    api_keys: tuple[str, ...]  # empty: /v1 is open
    block_size: int
    kv_cache_tokens: int
    token_delay_s: float
    prefix_caching: bool = True  # vLLM V1's default; --no-enable-prefix-caching turns it off
    # Images per prompt by --limit-mm-per-prompt; None without it: the model takes none.
    image_limit: int | None = None


@dataclass(frozen=True)
class OutputFaults:
    """Which silent output failures the engine shows (STANDIN_FAULT)."""

    token_loop: bool = False
    garbled: bool = False
    empty_content: bool = False
    bad_after: int | None = None
    # This share of the free-text answers (not a canary's, not a sentence to repeat) misspelled.
    typos: float | None = None
    hang_long_prompt: bool = False
    # A path in the container: while it exists, every completion fails as a dead engine core's
    # does, with /health still 200 (created by `docker exec` after ready, so a probe that trusts
    # /health alone is fooled, as by real vLLM after a worker dies).
    fail_requests_when: str | None = None


@dataclass
class Histogram:
    """A Prometheus histogram: one count per bucket (not cumulative here), sum, count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        index = next((i for i, le in enumerate(self.bounds) if value <= le), len(self.bounds))
        self.counts[index] += 1
        self.total += value

    def lines(self, name: str, labels: str) -> list[str]:
        counts = self.counts or [0] * (len(self.bounds) + 1)
        cumulative = 0
        out = []
        for le, count in zip((*(f"{b}" for b in self.bounds), "+Inf"), counts, strict=True):
            cumulative += count
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {float(cumulative)}')
        out.append(f"{name}_count{{{labels}}} {float(cumulative)}")
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        return out


@dataclass
class PrefixCache:
    """Full blocks of prompt tokens seen before, as vLLM's prefix cache hashes them (a block's
    hash chains its predecessor's), least recently used first out."""

    block_size: int
    capacity_blocks: int
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def lookup(self, prompt_tokens: list[str]) -> int:
        """Tokens of the prompt found cached (whole leading blocks; never the last token, which
        the engine computes anyway); the prompt's blocks are cached afterwards."""
        hits, parent, cached = 0, 0, True
        full = (len(prompt_tokens) - 1) // self.block_size
        for index in range(full):
            block = prompt_tokens[index * self.block_size : (index + 1) * self.block_size]
            parent = hash((parent, *block))
            if cached and parent in self.blocks:
                hits += self.block_size
                self.blocks.move_to_end(parent)
            else:
                cached = False
                self.blocks[parent] = None
                if len(self.blocks) > self.capacity_blocks:
                    self.blocks.popitem(last=False)
        return hits


@dataclass
class EngineState:
    config: ServingConfig
    faults: OutputFaults
    started: float = field(default_factory=time.time)
    dead: bool = False
    requests: int = 0
    running: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    free_answers: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    prefix_cache: PrefixCache | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.config.prefix_caching and self.prefix_cache is None:
            blocks = max(1, self.config.kv_cache_tokens // self.config.block_size)
            self.prefix_cache = PrefixCache(self.config.block_size, blocks)

    def misspells_next_free_answer(self) -> bool:
        """Counts a free-text answer; whether the typos switch degrades it. The k-th is degraded
        when floor(k x share) grows: exactly that share of them, evenly spread (the 20th, 40th,
        ... for 0.05)."""
        share = self.faults.typos
        if share is None:
            return False
        with self.lock:
            self.free_answers += 1
            count = self.free_answers
        return int(count * share) > int((count - 1) * share)


def metrics_page(state: EngineState) -> str:
    """The Prometheus text of GET /metrics: vLLM 0.32's names, labels and buckets."""
    config = state.config
    label = f'engine="0",model_name="{config.served_names[0]}"'
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{label}}} {float(state.running)}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{label}}} 0.0",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{label}}} 0.0",
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of "
        "queried tokens.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{{{label}}} {float(state.prefix_cache_queries)}",
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached "
        "tokens.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        f"vllm:prefix_cache_hits_total{{{label}}} {float(state.prefix_cache_hits)}",
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{label}}} 0.0",  # the stand-in never runs out of KV
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{label}}} {float(state.prompt_tokens)}",
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{label}}} {float(state.generation_tokens)}",
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
    ]
    for reason in ("stop", "length", "tool_calls"):
        count = float(state.finished.get(reason, 0))
        lines.append(f'vllm:request_success_total{{{label},finished_reason="{reason}"}} {count}')
    for name, help_text, histogram in (
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            state.ttft,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            state.itl,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            state.e2e,
        ),
    ):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        with state.lock:
            lines += histogram.lines(name, label)
    lines += [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{config.block_size}",engine="0",'
        f'num_gpu_blocks="{config.kv_cache_tokens // config.block_size}"}} 1.0',
    ]
    return "\n".join(lines) + "\n"
