"""The serving benchmark: streaming chat requests at a sweep of concurrencies.

Measured as `vllm bench serve` measures serving (vllm-project/vllm `vllm/benchmarks/serve.py`):
each level keeps `concurrency` requests in flight until `requests_per_level` are done; a request
asks for exactly `output_tokens` (max_tokens with vLLM's `ignore_eos`) after a synthetic prompt
of `input_tokens` as the engine's tokenizer counts them (the prompt is sized by asking the
engine: usage.prompt_tokens, chat template included). Per request: time to first token (TTFT),
the gaps between token chunks (inter-token latency, ITL), end to end (E2E); per level: their
p50/p90/p99, output tokens/s and requests/s over the level's wall time, errors, and the engine's
own count from /metrics before and after (sparkdeploy.vllm.metrics). Each level runs `repeats`
times; a figure is the median of its runs with their spread (half the range), the noise a
comparison allows for (sparkdeploy.steps.compare).

The client is threads over the smoke test's HTTP client (sparkdeploy.steps.smoke_test.chat_stream).
Its own cost is measured: the CPU time of each request's thread, and at the highest level the share
of one core the client used (its threads share one core: Python's GIL); above
CLIENT_BOUND_CORES the client, not the engine, may be what limits the figures.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sparkdeploy.errors import BenchmarkError
from sparkdeploy.remote import engine_http
from sparkdeploy.report import chart
from sparkdeploy.report.markdown import markdown_table
from sparkdeploy.steps.smoke_test import (
    FUNCTION_WORDS,
    SmokeSettings,
    StreamedReply,
    chat,
    chat_stream,
)
from sparkdeploy.vllm import metrics as engine_metrics
from sparkdeploy.vllm.metrics import EngineMetrics

CALIBRATION_PROBES = 4
# Above this share of one core the client's threads queue for the GIL and add to the latencies.
CLIENT_BOUND_CORES = 0.5
PROMPT_VOCABULARY = tuple(sorted(FUNCTION_WORDS))


class BenchmarkSettings(BaseModel):
    """What a benchmark asks of the endpoint (the Prefect UI's form shows these descriptions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    concurrency: list[Annotated[int, Field(ge=1)]] = Field(
        default=[1, 4, 16],
        min_length=1,
        description="Requests in flight at each level of the sweep. A level above the recipe's "
        "--max-num-seqs is lowered to it (more would only queue in the engine).",
    )
    input_tokens: int = Field(
        default=256,
        ge=1,
        description="Prompt length in tokens as the engine's tokenizer counts them "
        "(usage.prompt_tokens, chat template included); synthetic prompts are sized to it.",
    )
    output_tokens: int = Field(
        default=64,
        ge=2,
        description="Tokens generated per request: max_tokens with ignore_eos, so every "
        "request decodes the same length.",
    )
    requests_per_level: int = Field(
        default=32,
        ge=1,
        description="Requests per level and repeat (at least the level's concurrency).",
    )
    repeats: int = Field(
        default=3,
        ge=1,
        le=20,
        description="Runs of each level. A figure is their median; their spread is the noise "
        "a comparison allows before it calls a difference better or worse.",
    )
    request_timeout_s: float = Field(
        default=300.0, gt=0, description="Seconds a single request may take."
    )


DEFAULT_SETTINGS = BenchmarkSettings()  # frozen: one instance serves as every default


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile with linear interpolation (numpy's default, as vllm bench reports)."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def synthetic_prompt(words: int, seed: int) -> str:
    """`words` common English words drawn with `seed`: every request its own prompt, so the
    prefix cache helps no more than with real traffic."""
    rng = random.Random(seed)
    return " ".join(rng.choice(PROMPT_VOCABULARY) for _ in range(words))


@dataclass(frozen=True)
class PromptSize:
    target: int  # input_tokens asked for
    words: int  # synthetic words that make it
    counted: int  # what the engine counted for the calibration prompt


def size_prompt(settings: SmokeSettings, target: int) -> PromptSize:
    """The number of words whose prompt the engine counts as `target` tokens (or as close as
    it gets: a chat template alone may exceed a small target)."""
    probe = dataclasses.replace(settings, max_tokens=1, extra_body={})
    words, best = target, None
    for _ in range(CALIBRATION_PROBES):
        reply = chat(probe, "prompt sizing", synthetic_prompt(words, seed=-1))
        if reply.error is not None:
            raise BenchmarkError(
                f"sizing the prompt at {settings.base_url}: {reply.error}; is the deployment "
                "up and ready (sparkdeploy status, or deploy it first)?"
            )
        counted = reply.usage.get("prompt_tokens")
        if not isinstance(counted, int) or counted <= 0:
            raise BenchmarkError(
                f"{settings.base_url} answered without usage.prompt_tokens: the benchmark "
                "needs the engine's token counts (an OpenAI-compatible vLLM server gives them)"
            )
        if best is None or abs(counted - target) < abs(best.counted - target):
            best = PromptSize(target, words, counted)
        if counted == target:
            break
        words = max(1, words + round((target - counted) * words / counted))
    assert best is not None
    return best


def levels_for(requested: Sequence[int], max_num_seqs: int | None) -> tuple[list[int], str | None]:
    """The sweep's levels, ascending, each at most max_num_seqs; a note when one was lowered."""
    lowered = [level for level in requested if max_num_seqs is not None and level > max_num_seqs]
    levels = sorted({min(level, max_num_seqs or level) for level in requested})
    note = None
    if lowered:
        note = (
            f"level(s) {', '.join(map(str, sorted(set(lowered))))} lowered to {max_num_seqs}, "
            "the recipe's --max-num-seqs"
        )
    return levels, note


@dataclass(frozen=True)
class RequestSample:
    started_s: float  # since the level run's start
    ttft_s: float | None
    e2e_s: float
    itl_s: tuple[float, ...]
    prompt_tokens: int
    output_tokens: int
    client_cpu_s: float  # CPU time of the request's thread
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def decode_tok_s(self) -> float | None:
        """This request's decode rate: the tokens after the first over the time they took."""
        decode_s = sum(self.itl_s)
        if self.output_tokens < 2 or decode_s <= 0:
            return None
        return (self.output_tokens - 1) / decode_s


def _sample(streamed: StreamedReply, started_s: float, cpu_s: float) -> RequestSample:
    reply, times = streamed.reply, streamed.token_times_s
    output = reply.usage.get("completion_tokens")
    error = reply.error
    if error is None and not isinstance(output, int):
        error = "the stream ended without a usage chunk"
    return RequestSample(
        started_s=started_s,
        ttft_s=streamed.ttft_s,
        e2e_s=reply.seconds,
        itl_s=tuple(later - earlier for earlier, later in itertools.pairwise(times)),
        prompt_tokens=int(reply.usage.get("prompt_tokens") or 0),
        output_tokens=output if isinstance(output, int) else 0,
        client_cpu_s=cpu_s,
        error=error,
    )


Better = Literal["lower", "higher"]


Kind = Literal["latency", "rate", "count", "info"]


@dataclass(frozen=True)
class FigureSpec:
    name: str
    label: str  # for people: what and in which unit
    kind: Kind  # info: says what happened (tokens, client CPU), not how well
    better: Better | None = None
    scale: float = 1.0  # the label's unit per stored unit (seconds shown as ms: 1000)
    # For a percentile over the run's requests: its quantile (a p99 of 30 requests is their
    # maximum, which says little: sparkdeploy.steps.compare judges it only with enough requests).
    request_quantile: float | None = None


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec("ttft_p50_s", "TTFT p50 (ms)", "latency", "lower", 1000, 0.5),
    FigureSpec("ttft_p90_s", "TTFT p90 (ms)", "latency", "lower", 1000, 0.9),
    FigureSpec("ttft_p99_s", "TTFT p99 (ms)", "latency", "lower", 1000, 0.99),
    FigureSpec("itl_p50_s", "ITL p50 (ms)", "latency", "lower", 1000),
    FigureSpec("itl_p90_s", "ITL p90 (ms)", "latency", "lower", 1000),
    FigureSpec("itl_p99_s", "ITL p99 (ms)", "latency", "lower", 1000),
    FigureSpec("e2e_p50_s", "E2E p50 (s)", "latency", "lower", request_quantile=0.5),
    FigureSpec("e2e_p90_s", "E2E p90 (s)", "latency", "lower", request_quantile=0.9),
    FigureSpec("e2e_p99_s", "E2E p99 (s)", "latency", "lower", request_quantile=0.99),
    FigureSpec("output_tok_s", "output tok/s", "rate", "higher"),
    FigureSpec("requests_s", "requests/s", "rate", "higher"),
    FigureSpec("decode_tok_s_p50", "decode tok/s per request (p50)", "rate", "higher", 1, 0.5),
    FigureSpec("errors", "errors", "count", "lower"),
    FigureSpec("prompt_tokens_mean", "prompt tokens (engine's count)", "info"),
    FigureSpec("engine_generation_tokens", "engine: generation tokens", "info"),
    FigureSpec("engine_ttft_mean_s", "engine: TTFT mean (ms)", "latency", "lower", 1000),
    FigureSpec("engine_preemptions", "engine: preemptions", "count", "lower"),
    FigureSpec("engine_prefix_cache_hit_rate", "engine: prefix-cache hit rate", "info"),
    FigureSpec("client_cpu_ms_per_request", "client CPU per request (ms)", "info"),
    FigureSpec("client_cpu_cores", "client CPU (share of one core)", "info"),
)
FIGURE_BY_NAME = {spec.name: spec for spec in FIGURES}


@dataclass(frozen=True)
class LevelRun:
    """One run of one level: every request's sample and what the engine counted meanwhile."""

    concurrency: int
    repeat: int
    wall_s: float
    samples: tuple[RequestSample, ...]
    engine: EngineMetrics | None  # the difference of /metrics across the run
    engine_error: str | None = None

    def figures(self) -> dict[str, float]:
        ok = [sample for sample in self.samples if sample.ok]
        figures: dict[str, float] = {
            "errors": float(len(self.samples) - len(ok)),
            "output_tok_s": sum(s.output_tokens for s in ok) / self.wall_s,
            "requests_s": len(ok) / self.wall_s,
        }
        columns: dict[str, list[float]] = {
            "ttft": [s.ttft_s for s in ok if s.ttft_s is not None],
            "itl": [gap for s in ok for gap in s.itl_s],
            "e2e": [s.e2e_s for s in ok],
        }
        for name, values in columns.items():
            for q in (50, 90, 99):
                value = percentile(values, q / 100)
                if value is not None:
                    figures[f"{name}_p{q}_s"] = value
        decode = percentile([r for s in ok if (r := s.decode_tok_s) is not None], 0.5)
        if decode is not None:
            figures["decode_tok_s_p50"] = decode
        if ok:
            figures["prompt_tokens_mean"] = statistics.fmean(s.prompt_tokens for s in ok)
        cpu = [sample.client_cpu_s for sample in self.samples]
        figures["client_cpu_ms_per_request"] = 1000 * statistics.fmean(cpu)
        figures["client_cpu_cores"] = sum(cpu) / self.wall_s
        if self.engine is not None:
            engine = self.engine.figures()
            for name in ("generation_tokens", "preemptions", "prefix_cache_hit_rate"):
                if name in engine:
                    figures[f"engine_{name}"] = engine[name]
            if "ttft_mean_s" in engine:
                figures["engine_ttft_mean_s"] = engine["ttft_mean_s"]
        return figures


@dataclass(frozen=True)
class Spread:
    """A figure over the runs of a level: the median and half the range."""

    value: float
    spread: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), (max(values) - min(values)) / 2, tuple(values))


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    runs: tuple[LevelRun, ...]

    @property
    def requests_per_run(self) -> int:
        return min(len(run.samples) for run in self.runs)

    def figures(self) -> dict[str, Spread]:
        per_run = [run.figures() for run in self.runs]
        names = [spec.name for spec in FIGURES if all(spec.name in f for f in per_run)]
        return {name: Spread.of([figures[name] for figures in per_run]) for name in names}


@dataclass(frozen=True)
class ClientCheck:
    concurrency: int
    cpu_ms_per_request: float
    cores: float

    @property
    def client_bound(self) -> bool:
        return self.cores >= CLIENT_BOUND_CORES

    def text(self) -> str:
        verdict = (
            f"the client may be the bottleneck (over {CLIENT_BOUND_CORES} of a core): use "
            "fewer levels or a shorter output, or read the figures as the client's limit"
            if self.client_bound
            else "the client is not the bottleneck"
        )
        return (
            f"client CPU {self.cpu_ms_per_request:.2f} ms per request; at concurrency "
            f"{self.concurrency} the client used {self.cores:.3f} of one core: {verdict}"
        )


@dataclass(frozen=True)
class BenchmarkResult:
    base_url: str
    served_model_name: str
    settings: dict[str, Any]  # BenchmarkSettings.model_dump()
    prompt: PromptSize
    levels: tuple[LevelResult, ...]
    lowered: str | None  # the note of levels_for
    started_at: str  # UTC, ISO 8601 (2025-01-31T12:00:00Z)
    label: str = ""  # the compare side, or the recipe

    def figures(self) -> dict[int, dict[str, Spread]]:
        return {level.concurrency: level.figures() for level in self.levels}

    @property
    def client_check(self) -> ClientCheck:
        highest = self.levels[-1]
        figures = highest.figures()
        return ClientCheck(
            highest.concurrency,
            figures["client_cpu_ms_per_request"].value,
            figures["client_cpu_cores"].value,
        )

    def engine_disagreements(self) -> list[str]:
        """Levels where the engine counted other generation tokens than our replies' usage."""
        notes = []
        for level in self.levels:
            for run in level.runs:
                if run.engine is None or engine_metrics.GENERATION_TOKENS in run.engine.missing:
                    continue
                ours = sum(sample.output_tokens for sample in run.samples if sample.ok)
                if run.engine.generation_tokens != ours:
                    notes.append(
                        f"concurrency {level.concurrency} run {run.repeat + 1}: the engine "
                        f"counted {run.engine.generation_tokens:g} generation tokens, our "
                        f"replies {ours} (another client's requests meanwhile?)"
                    )
        return notes

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def table_rows(self) -> list[dict[str, str]]:
        """One row per level for a Prefect table artifact: each figure as median ± spread."""
        rows = []
        for level in self.levels:
            row = {"concurrency": str(level.concurrency)}
            for name, spread in level.figures().items():
                row[FIGURE_BY_NAME[name].label] = format_spread(name, spread)
            rows.append(row)
        return rows

    def chart_panels(self) -> list[chart.Panel]:
        return chart_panels({self.label or self.served_model_name: self})

    def markdown(self, raw_path: str | None = None) -> str:
        settings = BenchmarkSettings.model_validate(self.settings)
        lines = [
            f"# Benchmark of {self.label or self.served_model_name}",
            "",
            f"`{self.served_model_name}` at {self.base_url}, {self.started_at}: streaming chat "
            f"requests of {self.prompt.counted} prompt tokens (asked {self.prompt.target}) and "
            f"{settings.output_tokens} output tokens, {settings.requests_per_level} per level, "
            f"each level run {settings.repeats} times (median ± half the range).",
            "",
            chart.markdown_image("throughput and latency against concurrency", self.chart_svg()),
            "",
            *markdown_table(
                ["figure", *(f"c={level.concurrency}" for level in self.levels)],
                [
                    [
                        spec.label,
                        *(
                            format_spread(spec.name, level.figures().get(spec.name))
                            for level in self.levels
                        ),
                    ]
                    for spec in FIGURES
                ],
            ),
            "",
            self.client_check.text() + ".",
        ]
        if self.lowered:
            lines += ["", f"Levels: {self.lowered}."]
        lines += [f"- {note}" for note in self.engine_disagreements()]
        if raw_path:
            lines += ["", f"Every request's figures: `{raw_path}`."]
        return "\n".join(lines)

    def chart_svg(self) -> str:
        return chart.svg(self.chart_panels())


CHART_FIGURES = (
    ("output tok/s", "output_tok_s"),
    ("TTFT p50 (ms)", "ttft_p50_s"),
    ("E2E p50 (s)", "e2e_p50_s"),
)


def chart_panels(results: dict[str, BenchmarkResult]) -> list[chart.Panel]:
    """Throughput and latency against concurrency, one series per result."""
    panels = []
    for title, name in CHART_FIGURES:
        scale = FIGURE_BY_NAME[name].scale
        series = []
        for label, result in results.items():
            points = [
                chart.Point(level, spread.value * scale, spread.spread * scale)
                for level, figures in result.figures().items()
                if (spread := figures.get(name)) is not None
            ]
            series.append(chart.Series(label, tuple(points)))
        panels.append(chart.Panel(title, tuple(series)))
    return panels


def format_value(name: str, value: float) -> str:
    spec = FIGURE_BY_NAME.get(name)
    scaled = value * (spec.scale if spec else 1.0)
    if name == "engine_prefix_cache_hit_rate":
        return f"{value:.1%}"
    if scaled == int(scaled) and abs(scaled) < 1e6:
        return f"{scaled:.0f}"
    return f"{scaled:.3g}" if abs(scaled) < 100 else f"{scaled:.0f}"


def format_spread(name: str, spread: Spread | None) -> str:
    if spread is None:
        return "—"
    text = format_value(name, spread.value)
    return text if spread.spread == 0 else f"{text} ± {format_value(name, spread.spread)}"


Progress = Callable[[str], None]


def run_level(
    settings: SmokeSettings, prompt: PromptSize, concurrency: int, requests: int, repeat: int
) -> LevelRun:
    """`requests` streamed requests, `concurrency` in flight; /metrics read around them."""
    before = engine_http.scrape_metrics(settings.base_url)
    started = time.monotonic()

    def one(index: int) -> RequestSample:
        seed = (concurrency * 1_000 + repeat) * 100_000 + index
        request_prompt = synthetic_prompt(prompt.words, seed)
        cpu_before, sent = time.thread_time(), time.monotonic()
        streamed = chat_stream(settings, f"c{concurrency} #{index}", request_prompt)
        return _sample(streamed, sent - started, time.thread_time() - cpu_before)

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bench") as pool:
        samples = tuple(pool.map(one, range(max(requests, concurrency))))
    wall = time.monotonic() - started
    after = engine_http.scrape_metrics(settings.base_url)
    engine = None
    if before.metrics is not None and after.metrics is not None:
        engine = after.metrics.minus(before.metrics)
    return LevelRun(concurrency, repeat, wall, samples, engine, before.error or after.error)


def run_benchmark(
    target: SmokeSettings,
    settings: BenchmarkSettings,
    *,
    max_num_seqs: int | None = None,
    label: str = "",
    progress: Progress = lambda line: None,
) -> BenchmarkResult:
    """The sweep against `target` (its URL, model, key and chat_template_kwargs; the smoke
    test's settings of the deployment)."""
    request = dataclasses.replace(
        target,
        max_tokens=settings.output_tokens,
        extra_body={**target.extra_body, "ignore_eos": True},
        request_timeout_s=settings.request_timeout_s,
    )
    started_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    prompt = size_prompt(request, settings.input_tokens)
    progress(
        f"prompt of {prompt.words} words: {prompt.counted} tokens as the engine counts them "
        f"(asked {prompt.target})"
    )
    levels, lowered = levels_for(settings.concurrency, max_num_seqs)
    if lowered:
        progress(lowered)
    results = []
    for concurrency in levels:
        runs = []
        for repeat in range(settings.repeats):
            run = run_level(request, prompt, concurrency, settings.requests_per_level, repeat)
            figures = run.figures()
            progress(
                f"concurrency {concurrency} run {repeat + 1}/{settings.repeats}: "
                f"{figures['output_tok_s']:.1f} output tok/s, "
                f"TTFT p50 {1000 * figures.get('ttft_p50_s', math.nan):.1f} ms, "
                f"{figures['errors']:.0f} errors"
            )
            runs.append(run)
        results.append(LevelResult(concurrency, tuple(runs)))
    return BenchmarkResult(
        base_url=target.base_url,
        served_model_name=target.served_model_name,
        settings=settings.model_dump(),
        prompt=prompt,
        levels=tuple(results),
        lowered=lowered,
        started_at=started_at,
        label=label,
    )


def save_raw(result: BenchmarkResult, runs_dir: str, deployment_id: str) -> Path:
    """Every request's figures as JSON beside the deployment's logs on the NAS
    (`<runs_dir>/<deployment id>/benchmark-<UTC time>.json`, as teardown keeps `<node>.log`)."""
    directory = Path(runs_dir) / deployment_id
    path = directory / f"benchmark-{result.started_at.replace('-', '').replace(':', '')}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f".{path.name}.partial"
        partial.write_text(json.dumps(result.to_json(), indent=1))
        os.replace(partial, path)
    except OSError as error:
        raise BenchmarkError(
            f"cannot save the benchmark's results under {directory}: {error}; check that the "
            "NAS runs_dir is mounted and writable on the flow host"
        ) from error
    return path
