"""An OpenAI completion as the stand-in makes it: the model's output for a request (the fault
switches applied), and the response body, plain or as SSE stream events, as vLLM words them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

try:
    from lab.engine import standin_answers as answers
    from lab.engine.standin_state import EngineState, ServingConfig
except ImportError:  # copied flat into the engine image
    import standin_answers as answers  # type: ignore[no-redef, import-not-found]
    from standin_state import EngineState, ServingConfig  # type: ignore[no-redef, import-not-found]

# Cap on generated tokens when a request sets no max_tokens (a loop must end somewhere).
DEFAULT_MAX_TOKENS = 512


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass(frozen=True)
class Generation:
    """One request's output before it is put in an OpenAI response."""

    content: str | None
    reasoning: str
    tool_name: str | None
    tool_arguments: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def message_text(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return ""


def generate(
    state: EngineState,
    body: Mapping[str, Any],
    prompt_text: str,
    prompt_tokens: int,
    request_number: int,
    colours: Sequence[str] = (),
) -> Generation:
    """The model's output for a request (`colours`: what its pictures show), the fault
    switches applied."""
    config, faults = state.config, state.faults
    requested = body.get("max_completion_tokens") or body.get("max_tokens")
    budget = (
        int(requested)
        if requested
        else min(DEFAULT_MAX_TOKENS, max(1, config.max_model_len - prompt_tokens))
    )
    template_kwargs = body.get("chat_template_kwargs") or {}
    thinking = answers.reasoning(
        prompt_text, answers.reasoning_budget(config.reasoning_parser, template_kwargs)
    )
    thinking_tokens = answers.tokens(thinking)[:budget]
    thinking = "".join(thinking_tokens).strip()
    budget_left = budget - len(thinking_tokens)

    tools = body.get("tools") or []
    tool_choice = body.get("tool_choice", "auto" if tools else "none")
    if tools and tool_choice != "none":
        if tool_choice == "auto" and not (config.auto_tool_choice and config.tool_call_parser):
            raise ApiError(400, "BadRequestError", answers.TOOL_CHOICE_NEEDS_FLAGS)
        function = answers.choose_tool(tools, tool_choice, prompt_text)
        arguments = answers.tool_arguments(function, prompt_text)
        return Generation(
            None,
            thinking,
            str(function.get("name")),
            arguments,
            "tool_calls",
            prompt_tokens,
            len(thinking_tokens) + answers.count_tokens(arguments) + 2,
        )

    bad = faults.garbled or (faults.bad_after is not None and request_number > faults.bad_after)
    if faults.token_loop:
        text = answers.token_loop(budget_left)
    elif faults.empty_content:
        text = ""
    else:
        # What a picture shows has one right answer, as a canary has: never a free one.
        text = answers.picture_answer(colours) if colours else answers.answer(prompt_text)
        free = not colours and answers.fixed_answer(prompt_text) is None
        if bad:
            text = answers.garble(text)
        elif free and state.misspells_next_free_answer():
            text = answers.misspell(text)
    if body.get("ignore_eos"):
        # vLLM's sampling extra: generate until max_tokens, past the end of the answer
        text = answers.past_eos(text, budget_left)
    pieces = answers.tokens(text)
    finish = "stop"
    if len(pieces) > budget_left:
        pieces, finish = pieces[: max(budget_left, 0)], "length"
    content = "".join(pieces).strip() if pieces or not thinking_tokens else None
    return Generation(
        content, thinking, None, "", finish, prompt_tokens, len(thinking_tokens) + len(pieces)
    )


def _usage(generation: Generation) -> dict[str, int]:
    return {
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "total_tokens": generation.prompt_tokens + generation.completion_tokens,
    }


def _tool_call(request_id: str, generation: Generation) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-tool-{request_id[:16]}",
        "type": "function",
        "function": {"name": generation.tool_name, "arguments": generation.tool_arguments},
    }


def response_body(
    chat: bool, request_id: str, model: str, generation: Generation, config: ServingConfig
) -> dict[str, Any]:
    created = int(time.time())
    if not chat:
        return {
            "id": f"cmpl-{request_id}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": generation.content or "",
                    "logprobs": None,
                    "finish_reason": generation.finish_reason,
                }
            ],
            "usage": _usage(generation),
        }
    message: dict[str, Any] = {"role": "assistant", "content": generation.content}
    if config.reasoning_parser is not None:
        thinking = generation.reasoning or None
        message["reasoning"] = thinking
        message["reasoning_content"] = thinking
    message["tool_calls"] = (
        [_tool_call(request_id, generation)] if generation.tool_name is not None else []
    )
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": generation.finish_reason,
                "stop_reason": None,
            }
        ],
        "usage": _usage(generation),
    }


def stream_events(
    chat: bool,
    request_id: str,
    model: str,
    generation: Generation,
    config: ServingConfig,
    include_usage: bool,
) -> Iterator[tuple[str, bool]]:
    """The SSE events' data, each with whether it carries a generated token."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    prefix = "chatcmpl" if chat else "cmpl"

    def chunk(choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> str:
        event: dict[str, Any] = {
            "id": f"{prefix}-{request_id}",
            "object": kind,
            "created": created,
            "model": model,
            "choices": [] if choice is None else [choice],
        }
        if usage is not None:
            event["usage"] = usage
        return json.dumps(event)

    def delta(fields: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        if not chat:
            return {
                "index": 0,
                "text": fields.get("content", ""),
                "logprobs": None,
                "finish_reason": finish,
            }
        return {"index": 0, "delta": fields, "logprobs": None, "finish_reason": finish}

    if chat:
        yield chunk(delta({"role": "assistant", "content": ""})), False
        for piece in answers.tokens(generation.reasoning):
            yield chunk(delta({"reasoning": piece, "reasoning_content": piece})), True
    if generation.tool_name is not None:
        call = _tool_call(request_id, generation)
        call["function"]["arguments"] = ""
        yield chunk(delta({"tool_calls": [{"index": 0, **call}]})), True
        arguments = {"arguments": generation.tool_arguments}
        yield chunk(delta({"tool_calls": [{"index": 0, "function": arguments}]})), True
    for piece in answers.tokens(generation.content or ""):
        yield chunk(delta({"content": piece})), True
    yield chunk(delta({}, generation.finish_reason)), False
    if include_usage:
        yield chunk(None, _usage(generation)), False
    yield "[DONE]", False
