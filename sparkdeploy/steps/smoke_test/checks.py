"""The smoke test's checks, in the order their requests go: does the endpoint answer, and answer
well?

The order matters: a fault that starts at the 5th-6th request must land in the burst, after the
canaries passed. The three canaries at temperature 0, sent together; a burst of sequential canary
requests; a prompt over 64 tokens, an exact-copy request, a tool call when auto tool choice is on
and a picture when the engine takes images (image.py), sent together; last, alone so that its
figures are the engine's for one request, a streaming request with usage (TTFT and decode tok/s).
Every reply then goes through the detectors (token loops, garbled text, empty content). One
failed check fails the report.

Requests sent together are independent questions that the engine batches (vLLM's scheduler runs
every waiting request it has room for in the same step: vllm/v1/core/sched/scheduler.py in
vllm-project/vllm), so they cost about one request's time instead of the sum.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from sparkdeploy.remote import engine_http
from sparkdeploy.steps.smoke_test.client import (
    Reply,
    SmokeSettings,
    StreamedReply,
    chat,
    chat_stream,
)
from sparkdeploy.steps.smoke_test.detectors import (
    copied_share,
    copy_mismatches,
    detect_garbled,
    detect_repetition,
)
from sparkdeploy.steps.smoke_test.image import (
    IMAGE_COLOUR,
    IMAGE_CONTENT,
    IMAGE_SIDE,
    names_the_colour,
)
from sparkdeploy.steps.smoke_test.prompts import (
    CANARIES,
    COPY_PROMPT,
    COPY_SENTENCE,
    LONG_PROMPT,
    STREAM_PROMPT,
    TOOL_PROMPT,
    WEATHER_TOOL,
    Canary,
)
from sparkdeploy.steps.smoke_test.report import SmokeCheck, SmokeReport
from sparkdeploy.vllm import metrics as engine_metrics

LONG_PROMPT_MIN_TOKENS = 64
# Below this share of the sentence's words the reply is no copy at all, not a copy with typos.
COPY_MIN_SHARE = 0.5


def _excerpt(text: str, limit: int = 120) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= limit else flat[:limit] + "...")


def _reply_problem(reply: Reply) -> str | None:
    """Why a reply is no answer at all (error, empty content), or None."""
    if reply.error:
        return reply.error
    if not reply.content.strip():
        detail = f"empty content (finish_reason={reply.finish_reason}"
        if reply.reasoning:
            detail += f", {len(reply.reasoning)} characters of reasoning"
        return detail + ")"
    return None


def _text_problems(reply: Reply) -> list[str]:
    problems = []
    for part, text in (("content", reply.content), ("reasoning", reply.reasoning)):
        for detector in (detect_repetition, detect_garbled):
            finding = detector(text)
            if finding:
                problems.append(f"{part}: {finding}")
    return problems


def _canary_verdict(canary: Canary, reply: Reply) -> str | None:
    problem = _reply_problem(reply)
    if problem:
        return problem
    if not canary.is_answer(reply.content):
        return f"wrong answer: expected {canary.expected}, got {_excerpt(reply.content)}"
    text = _text_problems(reply)
    return "; ".join(text) if text else None


def _canary_check(canary: Canary, reply: Reply) -> SmokeCheck:
    verdict = _canary_verdict(canary, reply)
    figures = {"seconds": round(reply.seconds, 3)}
    if verdict is None:
        return SmokeCheck(canary.name, True, f"answered {_excerpt(reply.content, 60)}", figures)
    return SmokeCheck(canary.name, False, verdict, figures)


def _burst_check(replies: Sequence[tuple[Canary, Reply]], first_request: int) -> SmokeCheck:
    bad = [
        (index, reply.label, verdict)
        for index, (canary, reply) in enumerate(replies, start=1)
        if (verdict := _canary_verdict(canary, reply))
    ]
    seconds = [reply.seconds for _, reply in replies if reply.error is None]
    figures = {
        "requests": float(len(replies)),
        "good": float(len(replies) - len(bad)),
        "mean_seconds": round(sum(seconds) / len(seconds), 3) if seconds else 0.0,
    }
    if not bad:
        return SmokeCheck("burst", True, f"{len(replies)} sequential requests all right", figures)
    index, label, verdict = bad[0]
    evidence = (
        f"request {index} of {len(replies)} (#{first_request + index - 1} overall, "
        f"{label}) went bad: {verdict}; {len(bad)} bad in all"
    )
    return SmokeCheck("burst", False, evidence, figures)


def _long_prompt_check(reply: Reply) -> SmokeCheck:
    figures = {"seconds": round(reply.seconds, 3)}
    prompt_tokens = reply.usage.get("prompt_tokens")
    if isinstance(prompt_tokens, int):
        figures["prompt_tokens"] = float(prompt_tokens)
    verdict = _canary_verdict(CANARIES[0], reply)
    if (
        verdict is None
        and isinstance(prompt_tokens, int)
        and prompt_tokens <= LONG_PROMPT_MIN_TOKENS
    ):
        verdict = (
            f"the engine counted {prompt_tokens} prompt tokens, not over "
            f"{LONG_PROMPT_MIN_TOKENS}: the check did not test a long prompt"
        )
    if verdict is None:
        return SmokeCheck("long_prompt", True, f"answered {_excerpt(reply.content, 60)}", figures)
    return SmokeCheck("long_prompt", False, verdict, figures)


def _stream_check(streamed: StreamedReply) -> SmokeCheck:
    reply = streamed.reply
    figures = {"chunks": float(streamed.chunks)}
    if streamed.ttft_s is not None:
        figures["ttft_s"] = round(streamed.ttft_s, 3)
    if streamed.decode_tok_s is not None:
        figures["decode_tok_s"] = round(streamed.decode_tok_s, 1)
    tokens = reply.usage.get("completion_tokens")
    if isinstance(tokens, int):
        figures["completion_tokens"] = float(tokens)
    problem = _reply_problem(reply)
    if problem is None and not isinstance(tokens, int):
        problem = "the stream ended without a usage chunk (stream_options.include_usage)"
    if problem:
        return SmokeCheck("streaming", False, problem, figures)
    return SmokeCheck("streaming", True, f"streamed {_excerpt(reply.content, 60)}", figures)


def _copy_check(reply: Reply) -> SmokeCheck:
    problem = _reply_problem(reply)
    if problem is None:
        changes = copy_mismatches(COPY_SENTENCE, reply.content)
        if copied_share(COPY_SENTENCE, reply.content) < COPY_MIN_SHARE:
            problem = f"did not repeat the sentence: got {_excerpt(reply.content)}"
        elif changes:
            problem = f"copied with {len(changes)} change(s) (typos?): {'; '.join(changes[:5])}"
    if problem:
        return SmokeCheck("exact_copy", False, problem, {"seconds": round(reply.seconds, 3)})
    return SmokeCheck("exact_copy", True, "the sentence came back word for word")


def _tool_check(reply: Reply) -> SmokeCheck:
    if reply.error:
        return SmokeCheck("tool_call", False, reply.error)
    if not reply.tool_calls:
        return SmokeCheck(
            "tool_call",
            False,
            f"no tool_calls in the reply (content {_excerpt(reply.content, 80)}); check "
            "--tool-call-parser",
        )
    function = reply.tool_calls[0].get("function") or {}
    try:
        arguments = json.loads(function.get("arguments") or "")
    except ValueError:
        return SmokeCheck("tool_call", False, f"arguments are not JSON: {function!r}")
    city = str(arguments.get("city", "")) if isinstance(arguments, dict) else ""
    if function.get("name") != "get_weather" or "paris" not in city.lower():
        return SmokeCheck("tool_call", False, f"unexpected call: {function!r}")
    return SmokeCheck("tool_call", True, f"get_weather({arguments})")


def _image_check(reply: Reply) -> SmokeCheck:
    figures = {"seconds": round(reply.seconds, 3)}
    problem = _reply_problem(reply)
    if problem is None and not names_the_colour(reply.content):
        problem = (
            f"wrong answer: a {IMAGE_SIDE}x{IMAGE_SIDE} {IMAGE_COLOUR} picture, got "
            f"{_excerpt(reply.content)}"
        )
    if problem:
        return SmokeCheck("image", False, problem, figures)
    return SmokeCheck(
        "image", True, f"saw the {IMAGE_COLOUR} picture: {_excerpt(reply.content, 60)}", figures
    )


def _reasoning_check(replies: Sequence[Reply]) -> SmokeCheck:
    with_reasoning = [reply for reply in replies if reply.reasoning.strip()]
    figures = {"replies": float(len(replies)), "with_reasoning": float(len(with_reasoning))}
    if with_reasoning:
        sample = with_reasoning[0]
        return SmokeCheck(
            "reasoning", True, f"{sample.label}: {_excerpt(sample.reasoning, 60)}", figures
        )
    return SmokeCheck(
        "reasoning",
        False,
        "no reply carried reasoning (message.reasoning / reasoning_content) although a "
        "reasoning parser is set",
        figures,
    )


def _detector_check(
    name: str, replies: Iterable[Reply], find: Callable[[Reply], str | None]
) -> SmokeCheck:
    findings = [(reply.label, finding) for reply in replies if (finding := find(reply))]
    if not findings:
        return SmokeCheck(name, True, "none found", {"replies_affected": 0.0})
    label, finding = findings[0]
    more = f" (and {len(findings) - 1} more replies)" if len(findings) > 1 else ""
    return SmokeCheck(
        name, False, f"{label}: {finding}{more}", {"replies_affected": float(len(findings))}
    )


def _loop_in(reply: Reply) -> str | None:
    return detect_repetition(reply.content) or detect_repetition(reply.reasoning)


def _garbled_in(reply: Reply) -> str | None:
    return detect_garbled(reply.content) or detect_garbled(reply.reasoning)


def _empty_in(reply: Reply) -> str | None:
    if reply.error or reply.tool_calls:
        return None  # no reply at all is the other checks' evidence; a tool call has no content
    return _reply_problem(reply)


def _our_counts(replies: Sequence[Reply], streamed: StreamedReply) -> dict[str, float]:
    """What our replies say the engine did, named as EngineMetrics.figures() names it."""
    answered = [reply for reply in replies if reply.error is None]

    def usage_sum(key: str) -> float:
        return float(sum(int(reply.usage.get(key) or 0) for reply in answered))

    ours = {
        "prompt_tokens": usage_sum("prompt_tokens"),
        "generation_tokens": usage_sum("completion_tokens"),
        "requests_finished": float(len(answered)),
    }
    if streamed.ttft_s is not None:
        ours["ttft_mean_s"] = round(streamed.ttft_s, 4)
    return ours


def _together(requests: Sequence[Callable[[], Reply]]) -> list[Reply]:
    """The replies to requests sent at once, in the order given."""
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        return list(pool.map(lambda request: request(), requests))


def run_smoke(settings: SmokeSettings) -> SmokeReport:
    """Every check against the endpoint; never raises for a bad engine (see raise_if_failed)."""
    checks: list[SmokeCheck] = []
    replies: list[Reply] = []
    before = engine_http.scrape_metrics(settings.base_url)

    canary_replies = _together(
        [partial(chat, settings, canary.name, canary.prompt) for canary in CANARIES]
    )
    checks += [_canary_check(c, r) for c, r in zip(CANARIES, canary_replies, strict=True)]
    replies += canary_replies

    burst = [
        (canary, chat(settings, f"burst {index + 1} ({canary.name})", canary.prompt))
        for index in range(settings.burst_size)
        for canary in (CANARIES[index % len(CANARIES)],)
    ]
    checks.append(_burst_check(burst, first_request=len(replies) + 1))
    replies += [reply for _, reply in burst]

    asked: list[Callable[[], Reply]] = [
        partial(chat, settings, "long_prompt", LONG_PROMPT),
        partial(chat, settings, "exact_copy", COPY_PROMPT),
    ]
    if settings.tool_calls:
        asked.append(
            partial(
                chat, settings, "tool_call", TOOL_PROMPT, tools=[WEATHER_TOOL], tool_choice="auto"
            )
        )
    if settings.images:
        asked.append(partial(chat, settings, "image", IMAGE_CONTENT))
    long_reply, copy_reply, *more = _together(asked)
    tool_reply = more[: int(settings.tool_calls)]
    image_reply = more[int(settings.tool_calls) :]
    checks.append(_long_prompt_check(long_reply))
    checks.append(_copy_check(copy_reply))
    checks += [_tool_check(reply) for reply in tool_reply]
    checks += [_image_check(reply) for reply in image_reply]
    streamed = chat_stream(settings, "streaming", STREAM_PROMPT)
    checks.append(_stream_check(streamed))
    replies += [long_reply, copy_reply, *tool_reply, *image_reply, streamed.reply]

    if settings.reasoning:
        checks.append(_reasoning_check(canary_replies))

    checks.append(_detector_check("no_token_loops", replies, _loop_in))
    checks.append(_detector_check("no_garbled_text", replies, _garbled_in))
    checks.append(_detector_check("no_empty_content", replies, _empty_in))
    after = engine_http.scrape_metrics(settings.base_url)
    if before.metrics is None or after.metrics is None:
        return SmokeReport(
            settings.base_url,
            settings.served_model_name,
            checks,
            head_node=settings.head_node,
            engine_error=before.error or after.error,
        )
    activity = after.metrics.minus(before.metrics)
    return SmokeReport(
        settings.base_url,
        settings.served_model_name,
        checks,
        head_node=settings.head_node,
        engine=engine_metrics.beside_ours(activity, _our_counts(replies, streamed)),
    )
