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
comparison allows for (sparkdeploy.report.verdicts). What each figure is, and the artifacts'
tables, are sparkdeploy.report.benchmark_figures and benchmark_tables.

The client is threads over the smoke test's HTTP client (sparkdeploy.steps.smoke_test.chat_stream).
Its own cost is measured: the CPU time of each request's thread, and at the highest level the share
of one core the client used (its threads share one core: Python's GIL); above
CLIENT_BOUND_CORES the client, not the engine, may be what limits the figures.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from sparkdeploy.errors import BenchmarkError
from sparkdeploy.remote import engine_http
from sparkdeploy.report import chart
from sparkdeploy.report.benchmark_figures import (
    DEPTH_FIGURES,
    FIGURES,
    Spread,
    chart_panels,
    percentile,
)
from sparkdeploy.report.benchmark_tables import figures_table, level_rows
from sparkdeploy.steps.benchmark_depth import (
    DepthResult,
    depths_for,
    engine_max_model_len,
    run_depths,
)
from sparkdeploy.steps.benchmark_requests import (
    PromptSize,
    RequestSample,
    size_prompt,
    synthetic_prompt,
    timed_request,
)
from sparkdeploy.steps.smoke_test import SmokeSettings
from sparkdeploy.vllm import metrics as engine_metrics
from sparkdeploy.vllm.metrics import EngineMetrics

# Above this share of one core the client's threads queue for the GIL and add to the latencies.
CLIENT_BOUND_CORES = 0.5


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
    decode_depths: list[Annotated[int, Field(ge=0)]] = Field(
        default=[0, 8192],
        description="Context depths (tokens) at which one request alone measures the decode "
        "rate, `repeats` times each: d0 and d8192 as the field's bisects report them. A depth "
        "that with the output does not fit in the engine's max-model-len is lowered to what "
        "fits, with a note. [] measures none.",
    )


DEFAULT_SETTINGS = BenchmarkSettings()  # frozen: one instance serves as every default


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
    depths: tuple[DepthResult, ...] = ()
    depths_lowered: str | None = None  # the note of depths_for

    def figures(self) -> dict[int, dict[str, Spread]]:
        return {level.concurrency: level.figures() for level in self.levels}

    def depth_figures(self) -> dict[int, dict[str, Spread]]:
        """By depth as asked (a lowered one's context is its depth_context_tokens)."""
        return {depth.depth: depth.figures() for depth in self.depths}

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
        return level_rows(self.figures())

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
            *figures_table(self.figures()),
            "",
            self.client_check.text() + ".",
        ]
        if self.lowered:
            lines += ["", f"Levels: {self.lowered}."]
        if self.depths:
            lines += [
                "",
                f"Decode at a context depth: one request alone after that many tokens of "
                f"context, {settings.output_tokens} output tokens, run {settings.repeats} times.",
                "",
                *figures_table(self.depth_figures(), DEPTH_FIGURES, "d"),
            ]
        if self.depths_lowered:
            lines += ["", f"Depths: {self.depths_lowered}."]
        lines += [f"- {note}" for note in self.engine_disagreements()]
        if raw_path:
            lines += ["", f"Every request's figures: `{raw_path}`."]
        return "\n".join(lines)

    def chart_svg(self) -> str:
        label = self.label or self.served_model_name
        return chart.svg(chart_panels({label: self.figures()}, {label: self.depth_figures()}))


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
        return timed_request(settings, f"c{concurrency} #{index}", request_prompt, started)

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
    depths, depths_lowered = depths_for(
        settings.decode_depths, engine_max_model_len(target), settings.output_tokens
    )
    if depths_lowered:
        progress(depths_lowered)
    return BenchmarkResult(
        base_url=target.base_url,
        served_model_name=target.served_model_name,
        settings=settings.model_dump(),
        prompt=prompt,
        levels=tuple(results),
        lowered=lowered,
        started_at=started_at,
        label=label,
        depths=run_depths(request, depths, settings.repeats, prompt, progress),
        depths_lowered=depths_lowered,
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
