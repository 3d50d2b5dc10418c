"""One benchmark request and its figures, shared by the sweep of concurrencies
(sparkdeploy.steps.benchmark) and the decode at a context depth (benchmark_depth): a synthetic
prompt sized by the engine's own token count, and a streamed request's timings (TTFT, the gaps
between token chunks, end to end, the client's CPU)."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from dataclasses import dataclass

from sparkdeploy.errors import BenchmarkError
from sparkdeploy.steps.smoke_test import (
    FUNCTION_WORDS,
    SmokeSettings,
    StreamedReply,
    chat,
    chat_stream,
)

CALIBRATION_PROBES = 4
PROMPT_VOCABULARY = tuple(sorted(FUNCTION_WORDS))


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


def size_prompt(settings: SmokeSettings, target: int, first_guess: int | None = None) -> PromptSize:
    """The number of words whose prompt the engine counts as `target` tokens (or as close as
    it gets: a chat template alone may exceed a small target); the first probe has
    `first_guess` words (default `target`)."""
    probe = dataclasses.replace(settings, max_tokens=1, extra_body={})
    words, best = first_guess or target, None
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


def sample_of(streamed: StreamedReply, started_s: float, cpu_s: float) -> RequestSample:
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


def timed_request(
    settings: SmokeSettings, label: str, prompt: str, started: float
) -> RequestSample:
    """One streamed request; `started` is the monotonic time its run began."""
    cpu_before, sent = time.thread_time(), time.monotonic()
    streamed = chat_stream(settings, label, prompt)
    return sample_of(streamed, sent - started, time.thread_time() - cpu_before)
