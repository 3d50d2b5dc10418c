"""Decode speed at a context depth: one request after `depth` tokens of context, alone, as the
field's bisects measure a build ("d0 c1 23.5, d8192 26.6": decode tok/s with no context and after
8192 tokens of it). A long context slows each decode step (attention reads the whole KV cache), and
a build can be fast at d0 and slow at depth.

Each depth is one streamed request of a synthetic prompt sized by the engine's own token count
(the depth; 0: a one-word prompt, whatever the chat template adds), asking for `output_tokens`
with `ignore_eos`, run `repeats` times, each with its own prompt (so the prefix cache does not
skip the prefill its TTFT shows). A depth that with the output would not fit in the engine's
max-model-len (from its /v1/models) is lowered to what fits, and a note says so.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sparkdeploy.remote import engine_http
from sparkdeploy.report.benchmark_figures import DEPTH_FIGURES, Spread
from sparkdeploy.steps.benchmark_requests import (
    PromptSize,
    RequestSample,
    size_prompt,
    synthetic_prompt,
    timed_request,
)
from sparkdeploy.steps.smoke_test import SmokeSettings

# The sizing lands within a few tokens of its target, above it as often as below: this much room
# keeps a depth's prompt and its output inside max-model-len.
DEPTH_HEADROOM_TOKENS = 64
MODELS_TIMEOUT_S = 10.0


def engine_max_model_len(settings: SmokeSettings) -> int | None:
    """The max_model_len vLLM's /v1/models gives for the served model, None when it gives none."""
    url = settings.base_url.rstrip("/") + "/v1/models"
    try:
        answer = engine_http.request("GET", url, timeout=MODELS_TIMEOUT_S, api_key=settings.api_key)
        entries = answer.json()["data"] if answer.status == 200 else []
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError):
        return None
    for entry in entries:
        if isinstance(entry, dict) and entry.get("id") == settings.served_model_name:
            length = entry.get("max_model_len")
            return length if isinstance(length, int) and length > 0 else None
    return None


def depths_for(
    requested: Sequence[int], max_model_len: int | None, output_tokens: int
) -> tuple[list[tuple[int, int]], str | None]:
    """Each depth asked, ascending, with the context it is measured at: itself, or what
    max-model-len leaves beside the output and DEPTH_HEADROOM_TOKENS; a note when one was
    lowered."""
    room = None if max_model_len is None else max_model_len - output_tokens - DEPTH_HEADROOM_TOKENS
    depths = [(depth, depth if room is None else max(0, min(depth, room))) for depth in requested]
    depths = sorted(set(depths))
    lowered = [(asked, context) for asked, context in depths if context != asked]
    note = None
    if lowered:
        note = (
            ", ".join(f"depth {asked} measured at {context}" for asked, context in lowered)
            + f": the engine's max-model-len {max_model_len} leaves room for {room} tokens of "
            f"context before {output_tokens} output tokens (and {DEPTH_HEADROOM_TOKENS} to spare)"
        )
    return depths, note


@dataclass(frozen=True)
class DepthResult:
    """One context depth: as asked, as measured (lowered to max-model-len), and each run's
    request."""

    depth: int
    context: int
    runs: tuple[RequestSample, ...]

    def figures(self) -> dict[str, Spread]:
        ok = [sample for sample in self.runs if sample.ok]
        columns: dict[str, list[float]] = {
            "depth_decode_tok_s": [r for s in ok if (r := s.decode_tok_s) is not None],
            "depth_ttft_s": [s.ttft_s for s in ok if s.ttft_s is not None],
            "depth_context_tokens": [float(s.prompt_tokens) for s in ok],
        }
        figures = {name: Spread.of(values) for name, values in columns.items() if values}
        figures["depth_errors"] = Spread.of([float(len(self.runs) - len(ok))])
        return {spec.name: figures[spec.name] for spec in DEPTH_FIGURES if spec.name in figures}


def _depth_words(request: SmokeSettings, context: int, calibration: PromptSize) -> int:
    """The words whose prompt the engine counts as `context` tokens (one word for 0), sized from
    the first guess the sweep's own calibration gives (its words per token)."""
    if context == 0:
        return 1
    guess = max(1, round(context * calibration.words / max(calibration.counted, 1)))
    return size_prompt(request, context, first_guess=guess).words


def run_depths(
    request: SmokeSettings,
    depths: Sequence[tuple[int, int]],
    repeats: int,
    calibration: PromptSize,
    progress: Callable[[str], None],
) -> tuple[DepthResult, ...]:
    """Each (depth, context) measured `repeats` times, one request at a time, with `request`
    (the sweep's settings: output_tokens with ignore_eos)."""
    results = []
    for depth, context in depths:
        words = _depth_words(request, context, calibration)
        runs = []
        for repeat in range(repeats):
            seed = -(depth * 100 + repeat + 2)  # apart from the sweep's seeds and the sizing's
            text = synthetic_prompt(words, seed)
            sample = timed_request(request, f"d{depth} #{repeat}", text, time.monotonic())
            runs.append(sample)
            rate = sample.decode_tok_s
            progress(
                f"depth {depth} run {repeat + 1}/{repeats}: {sample.prompt_tokens} context "
                "tokens, "
                + (f"decode {rate:.1f} tok/s" if rate is not None else f"failed: {sample.error}")
            )
        results.append(DepthResult(depth, context, tuple(runs)))
    return tuple(results)
