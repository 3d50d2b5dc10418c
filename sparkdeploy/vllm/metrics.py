"""The engine's own account of what it did: vLLM's Prometheus `/metrics`, read before and after.

Names as real vLLM 0.32 exports them (vllm-project/vllm `vllm/v1/metrics/loggers.py`,
PrometheusStatLogger; prometheus_client adds `_total` to a counter and `_bucket`/`_sum`/`_count`
to a histogram; a real engine's page is in tests/fixtures/vllm-0.32-cpu/metrics.txt):

| figure | metric |
|---|---|
| prompt tokens | `vllm:prompt_tokens_total` |
| generation tokens | `vllm:generation_tokens_total` |
| finished requests | `vllm:request_success_total` (one series per finished_reason) |
| time to first token | `vllm:time_to_first_token_seconds` (histogram) |
| inter-token latency | `vllm:inter_token_latency_seconds` (histogram) |
| end-to-end latency | `vllm:e2e_request_latency_seconds` (histogram) |
| prefix cache | `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total` (tokens) |
| preemptions | `vllm:num_preemptions_total` |

Every figure is a counter, so what a run did is the difference of two scrapes (`minus`); series
of several engines (data parallel) or finish reasons are summed. An engine without the Prometheus
logger (`--disable-log-stats`) still answers /metrics, without these names: they are `missing`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
PREEMPTIONS = "vllm:num_preemptions_total"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"
COUNTERS = (
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    REQUEST_SUCCESS,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    PREEMPTIONS,
)
HISTOGRAMS = (TTFT, ITL, E2E)

# `name{label="value",...} value [timestamp]` (the Prometheus text exposition format,
# https://prometheus.io/docs/instrumenting/exposition_formats/); label values may hold escaped
# quotes.
_SAMPLE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>(?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?'
    r"\s+(?P<value>\S+)"
)
_LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_samples(text: str) -> list[Sample]:
    """Every sample line of a Prometheus text page; comments and unparsable lines skipped."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        labels = {label["key"]: label["value"] for label in _LABEL.finditer(match["labels"] or "")}
        samples.append(Sample(match["name"], labels, value))
    return samples


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram summed over its series: cumulative counts per upper bound."""

    buckets: tuple[tuple[float, float], ...] = ()  # (le, cumulative count), ascending, +Inf last
    sum: float = 0.0
    count: float = 0.0

    def minus(self, earlier: Histogram) -> Histogram:
        before = dict(earlier.buckets)
        return Histogram(
            tuple((le, count - before.get(le, 0.0)) for le, count in self.buckets),
            self.sum - earlier.sum,
            self.count - earlier.count,
        )

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear within the bucket holding the q-th
        observation; the largest finite bound when it falls in +Inf."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for le, count in self.buckets:
            if count >= rank:
                if math.isinf(le):
                    return lower_bound
                if count == lower_count:
                    return le
                return lower_bound + (le - lower_bound) * (rank - lower_count) / (
                    count - lower_count
                )
            lower_bound, lower_count = le, count
        return lower_bound


def _histogram(samples: Sequence[Sample], name: str) -> Histogram | None:
    by_bound: dict[float, float] = {}
    total = count = 0.0
    seen = False
    for sample in samples:
        if sample.name == f"{name}_bucket" and "le" in sample.labels:
            bound = float(sample.labels["le"])
            by_bound[bound] = by_bound.get(bound, 0.0) + sample.value
            seen = True
        elif sample.name == f"{name}_sum":
            total += sample.value
        elif sample.name == f"{name}_count":
            count += sample.value
            seen = True
    if not seen:
        return None
    return Histogram(tuple(sorted(by_bound.items())), total, count)


@dataclass(frozen=True)
class EngineMetrics:
    """The engine's counters at one scrape, or (after `minus`) what happened between two."""

    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    requests_finished: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    preemptions: float = 0.0
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    missing: tuple[str, ...] = ()  # metric names the page did not have

    def minus(self, earlier: EngineMetrics) -> EngineMetrics:
        return EngineMetrics(
            prompt_tokens=self.prompt_tokens - earlier.prompt_tokens,
            generation_tokens=self.generation_tokens - earlier.generation_tokens,
            requests_finished=self.requests_finished - earlier.requests_finished,
            prefix_cache_queries=self.prefix_cache_queries - earlier.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits - earlier.prefix_cache_hits,
            preemptions=self.preemptions - earlier.preemptions,
            ttft=self.ttft.minus(earlier.ttft),
            itl=self.itl.minus(earlier.itl),
            e2e=self.e2e.minus(earlier.e2e),
            missing=tuple(sorted({*self.missing, *earlier.missing})),
        )

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Share of the queried prompt tokens found in the prefix cache."""
        if self.prefix_cache_queries <= 0:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    def figures(self) -> dict[str, float]:
        """The figures for a table, each only when the engine exported its metric."""
        out = {}
        counters = {
            PROMPT_TOKENS: ("prompt_tokens", self.prompt_tokens),
            GENERATION_TOKENS: ("generation_tokens", self.generation_tokens),
            REQUEST_SUCCESS: ("requests_finished", self.requests_finished),
            PREEMPTIONS: ("preemptions", self.preemptions),
        }
        for metric, (name, value) in counters.items():
            if metric not in self.missing:
                out[name] = value
        hit_rate = self.prefix_cache_hit_rate
        if hit_rate is not None:
            out["prefix_cache_hit_rate"] = hit_rate
        for name, histogram in (("ttft", self.ttft), ("itl", self.itl), ("e2e", self.e2e)):
            if histogram.mean is not None:
                out[f"{name}_mean_s"] = histogram.mean
        return out


def parse_metrics(text: str) -> EngineMetrics:
    samples = parse_samples(text)
    totals: dict[str, float] = {}
    for sample in samples:
        if sample.name in COUNTERS:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    histograms = {name: _histogram(samples, name) for name in HISTOGRAMS}
    missing = [name for name in COUNTERS if name not in totals]
    missing += [name for name, histogram in histograms.items() if histogram is None]
    return EngineMetrics(
        prompt_tokens=totals.get(PROMPT_TOKENS, 0.0),
        generation_tokens=totals.get(GENERATION_TOKENS, 0.0),
        requests_finished=totals.get(REQUEST_SUCCESS, 0.0),
        prefix_cache_queries=totals.get(PREFIX_CACHE_QUERIES, 0.0),
        prefix_cache_hits=totals.get(PREFIX_CACHE_HITS, 0.0),
        preemptions=totals.get(PREEMPTIONS, 0.0),
        ttft=histograms[TTFT] or Histogram(),
        itl=histograms[ITL] or Histogram(),
        e2e=histograms[E2E] or Histogram(),
        missing=tuple(missing),
    )


@dataclass(frozen=True)
class EngineFigure:
    """One of the engine's figures beside the client's own count of the same thing."""

    name: str
    engine: float | None
    ours: float | None = None

    def text(self) -> str:
        engine = "not exported" if self.engine is None else f"{self.engine:g}"
        return f"engine {engine}" + ("" if self.ours is None else f", ours {self.ours:g}")


def beside_ours(activity: EngineMetrics, ours: Mapping[str, float]) -> list[EngineFigure]:
    """The engine's figures between two scrapes beside ours (same names as `figures()`)."""
    theirs = activity.figures()
    names = [
        "prompt_tokens",
        "generation_tokens",
        "requests_finished",
        "ttft_mean_s",
        "itl_mean_s",
        "e2e_mean_s",
        "prefix_cache_hit_rate",
        "preemptions",
    ]
    return [EngineFigure(name, theirs.get(name), ours.get(name)) for name in names]
