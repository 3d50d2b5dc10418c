"""The smoke test's HTTP client of an engine's OpenAI chat API: one completion (chat), one
streamed with its usage and token times (chat_stream). Every failure becomes Reply.error: the
checks judge it, the client never raises for a bad engine."""

from __future__ import annotations

import http.client
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import SecretStr

from sparkdeploy.remote import engine_http
from sparkdeploy.spec.plan import Plan
from sparkdeploy.vllm.args import images_per_prompt

# A user message's content: its text, or content parts (text and images: smoke_test/image.py).
Content = str | list[dict[str, Any]]


@dataclass(frozen=True)
class SmokeSettings:
    base_url: str  # e.g. "http://10.77.0.11:8000"
    served_model_name: str
    api_key: SecretStr | None = None  # sent as a bearer token (the plan's api_key)
    head_node: str = ""  # where the endpoint runs, for the failure message
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    tool_calls: bool = False  # the engine runs with --enable-auto-tool-choice
    reasoning: bool = False  # the engine runs with --reasoning-parser
    images: bool = False  # the engine takes an image per prompt (--limit-mm-per-prompt)
    burst_size: int = 8
    max_tokens: int = 1024
    request_timeout_s: float = 120.0

    @classmethod
    def for_plan(cls, plan: Plan, *, request_timeout_s: float | None = None) -> SmokeSettings:
        """The smoke test of a deployment: its endpoint, the checks its engine's flags enable
        and its recipe's [smoke] options (request_timeout_s, when given, before the recipe's)."""
        return cls(
            plan.endpoint,
            plan.served_model_name,
            api_key=plan.api_key,
            head_node=plan.head.node,
            chat_template_kwargs=dict(plan.smoke.chat_template_kwargs),
            tool_calls=plan.tool_calls_enabled,
            reasoning=plan.reasoning_enabled,
            images=images_per_prompt(plan.head_serve_argv) > 0,
            max_tokens=plan.smoke.max_tokens or cls.max_tokens,
            request_timeout_s=(
                request_timeout_s or plan.smoke.request_timeout_s or cls.request_timeout_s
            ),
        )


@dataclass(frozen=True)
class Reply:
    label: str
    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None  # no usable reply: refused, timed out, HTTP error, not JSON


def _request_body(settings: SmokeSettings, prompt: Content, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": settings.served_model_name,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": settings.max_tokens,
    }
    if settings.chat_template_kwargs:
        body["chat_template_kwargs"] = dict(settings.chat_template_kwargs)
    body.update(settings.extra_body)
    body.update(fields)
    return body


def _failure_text(error: BaseException, timeout: float) -> str:
    if isinstance(error, TimeoutError):
        return f"no answer within {timeout} s (a hang?)"
    if isinstance(error, ConnectionRefusedError):
        return "connection refused: the engine is not listening"
    return f"{type(error).__name__}: {error}"


def _reasoning_of(message: Mapping[str, Any]) -> str:
    return str(message.get("reasoning") or message.get("reasoning_content") or "")


def chat(settings: SmokeSettings, label: str, prompt: Content, **fields: Any) -> Reply:
    """One non-streaming chat completion; every failure becomes Reply.error."""
    url = settings.base_url.rstrip("/") + "/v1/chat/completions"
    started = time.monotonic()
    try:
        answer = engine_http.request(
            "POST",
            url,
            timeout=settings.request_timeout_s,
            json_body=_request_body(settings, prompt, **fields),
            api_key=settings.api_key,
        )
    except (OSError, http.client.HTTPException) as error:
        return Reply(label, error=_failure_text(error, settings.request_timeout_s))
    seconds = time.monotonic() - started
    if answer.status != 200:
        return Reply(label, seconds=seconds, error=f"HTTP {answer.status}: {answer.body[:300]!r}")
    try:
        document = answer.json()
        choice = document["choices"][0]
        message = choice["message"]
    except (ValueError, KeyError, IndexError, TypeError) as error:
        return Reply(label, seconds=seconds, error=f"not a chat completion ({error!r})")
    return Reply(
        label,
        content=str(message.get("content") or ""),
        reasoning=_reasoning_of(message),
        finish_reason=choice.get("finish_reason"),
        tool_calls=list(message.get("tool_calls") or []),
        usage=dict(document.get("usage") or {}),
        seconds=seconds,
    )


@dataclass(frozen=True)
class StreamedReply:
    reply: Reply
    ttft_s: float | None
    decode_tok_s: float | None
    chunks: int
    # Seconds from the request to each chunk that carried content or reasoning: the gaps are
    # the inter-token latencies, as `vllm bench serve` counts them (one chunk per engine step).
    token_times_s: tuple[float, ...] = ()


def chat_stream(settings: SmokeSettings, label: str, prompt: str) -> StreamedReply:
    """A streaming chat completion with usage; TTFT = first chunk with content or reasoning."""
    url = settings.base_url.rstrip("/") + "/v1/chat/completions"
    body = _request_body(settings, prompt, stream=True, stream_options={"include_usage": True})
    started = time.monotonic()
    content: list[str] = []
    reasoning: list[str] = []
    token_times: list[float] = []
    usage: dict[str, Any] = {}
    finish_reason = None
    chunks = 0
    try:
        for arrived, event in engine_http.stream_events(
            url, body, timeout=settings.request_timeout_s, api_key=settings.api_key
        ):
            chunks += 1
            if event.get("usage"):
                usage = dict(event["usage"])
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                piece, thought = str(delta.get("content") or ""), _reasoning_of(delta)
                if piece or thought:
                    token_times.append(arrived - started)
                content.append(piece)
                reasoning.append(thought)
                finish_reason = choice.get("finish_reason") or finish_reason
    except (OSError, http.client.HTTPException, ValueError) as error:
        failed = Reply(label, error=_failure_text(error, settings.request_timeout_s))
        return StreamedReply(failed, None, None, chunks)
    reply = Reply(
        label,
        content="".join(content),
        reasoning="".join(reasoning),
        finish_reason=finish_reason,
        usage=usage,
        seconds=time.monotonic() - started,
    )
    ttft = token_times[0] if token_times else None
    decode = None
    tokens = usage.get("completion_tokens")
    if isinstance(tokens, int) and tokens > 1 and token_times and token_times[-1] > token_times[0]:
        decode = (tokens - 1) / (token_times[-1] - token_times[0])
    return StreamedReply(reply, ttft, decode, chunks, tuple(token_times))
