"""The built-in evals, each a function of the endpoint's chat settings and its recipe table that
returns its EvalResult: the typo rate of long answers, exact answers, tool-call validity.

Their requests go CONCURRENCY at a time (an engine batches them). A request that gets no answer
at all (refused, timed out, an HTTP error) leaves the eval without a score, named so: that is
the endpoint failing, not the model answering badly.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import jsonschema

from sparkdeploy.report.quality import EvalResult
from sparkdeploy.spec.quality import ExactAnswersEval, ToolCallsEval, TypoRateEval
from sparkdeploy.steps.quality.prompts import (
    QUESTIONS,
    TOOL_REQUESTS,
    TOOLS,
    TYPO_PROMPTS,
    Question,
    ToolRequest,
)
from sparkdeploy.steps.quality.spelling import typo_rate
from sparkdeploy.steps.smoke_test import Reply, SmokeSettings, chat
from sparkdeploy.steps.smoke_test.detectors import numbers_in, words_in

CONCURRENCY = 4
# How many examples of what went wrong an eval's evidence quotes.
EXAMPLES = 5


def _ask(requests: Sequence[Callable[[], Reply]]) -> list[Reply]:
    with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        return list(pool.map(lambda request: request(), requests))


def _unanswered(replies: Sequence[Reply]) -> str | None:
    failed = [reply for reply in replies if reply.error is not None]
    if not failed:
        return None
    return (
        f"{len(failed)} of {len(replies)} requests got no answer; {failed[0].label}: "
        f"{failed[0].error}"
    )


def _excerpt(text: str, limit: int = 60) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= limit else flat[:limit] + "...")


def _percent(
    name: str,
    min_score: float,
    asked: int,
    bad: Sequence[str],
    good_word: str,
    started: float,
    failure: str | None,
) -> EvalResult:
    """A score in percent of the `asked` that are good (all but `bad`, quoted as evidence)."""
    good = asked - len(bad)
    return EvalResult(
        name,
        None if failure else 100 * good / asked,
        min_score,
        "min",
        asked,
        time.monotonic() - started,
        unit="percent",
        evidence=f"{good} of {asked} {good_word}"
        + (f"; {'; '.join(bad[:EXAMPLES])}" if bad else ""),
        error=failure,
    )


def typo_rate_eval(settings: SmokeSettings, spec: TypoRateEval) -> EvalResult:
    """Misspelled words over checked words (sparkdeploy.steps.quality.spelling) in `samples`
    long answers to everyday prompts."""
    started = time.monotonic()
    replies = _ask(
        [
            partial(
                chat,
                settings,
                f"typo_rate {index + 1}",
                TYPO_PROMPTS[index % len(TYPO_PROMPTS)],
                max_tokens=spec.max_tokens,
                temperature=spec.temperature,
            )
            for index in range(spec.samples)
        ]
    )

    def result(score: float | None, evidence: str = "", error: str | None = None) -> EvalResult:
        return EvalResult(
            "typo_rate",
            score,
            spec.max_typo_rate,
            "max",
            spec.samples,
            time.monotonic() - started,
            unit="rate",
            evidence=evidence,
            error=error,
        )

    failure = _unanswered(replies)
    if failure is not None:
        return result(None, error=failure)
    rate, checked, misspelled = typo_rate(reply.content for reply in replies)
    if not checked:
        return result(
            None,
            error=f"the {len(replies)} answers held no words to check (first: "
            f"{_excerpt(replies[0].content)}); a reasoning model may need [smoke] "
            "chat_template_kwargs or a larger max_tokens",
        )
    evidence = f"{len(misspelled)} of {checked} words misspelled"
    if misspelled:
        common = Counter(misspelled).most_common(EXAMPLES)
        evidence += ": " + ", ".join(repr(word) for word, _ in common)
    return result(rate, evidence)


def is_right(question: Question, content: str) -> bool:
    if question.kind == "number":
        return question.expected in numbers_in(content)
    return question.expected in (word.lower() for word in words_in(content))


def exact_answers_eval(settings: SmokeSettings, spec: ExactAnswersEval) -> EvalResult:
    """Percent of questions with one right answer that the endpoint answers right."""
    started = time.monotonic()
    questions = QUESTIONS[: spec.samples or len(QUESTIONS)]
    replies = _ask(
        [
            partial(chat, settings, f"exact_answers {index + 1}", question.prompt)
            for index, question in enumerate(questions)
        ]
    )
    failure = _unanswered(replies)
    wrong = [
        f"{question.prompt.split('?')[0]}? expected {question.expected}, got "
        f"{_excerpt(reply.content, 40)}"
        for question, reply in zip(questions, replies, strict=True)
        if not is_right(question, reply.content)
    ]
    return _percent(
        "exact_answers", spec.min_score, len(questions), wrong, "right", started, failure
    )


def tool_call_problem(request: ToolRequest, reply: Reply) -> str | None:
    """Why a reply is no valid call of the requested tool, or None."""
    if not reply.tool_calls:
        return f"no tool call (content {_excerpt(reply.content, 40)})"
    function = reply.tool_calls[0].get("function") or {}
    name = function.get("name")
    offered = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    if name not in offered:
        return f"called {name!r}, which was not offered"
    if name != request.function:
        return f"called {name!r}, not {request.function!r}"
    try:
        arguments: Any = json.loads(function.get("arguments") or "")
    except ValueError:
        return f"{name}: arguments are not JSON: {_excerpt(str(function.get('arguments')), 40)}"
    try:
        jsonschema.validate(arguments, offered[name])
    except jsonschema.ValidationError as error:
        return f"{name}({json.dumps(arguments)}): {error.message}"
    return None


def tool_calls_eval(settings: SmokeSettings, spec: ToolCallsEval) -> EvalResult:
    """Percent of requests answered with a call of the right tool whose arguments are JSON that
    matches the tool's schema. Every request offers every tool."""
    started = time.monotonic()
    requests = TOOL_REQUESTS[: spec.samples or len(TOOL_REQUESTS)]
    replies = _ask(
        [
            partial(
                chat,
                settings,
                f"tool_calls {index + 1}",
                request.prompt,
                tools=list(TOOLS),
                tool_choice="auto",
            )
            for index, request in enumerate(requests)
        ]
    )
    failure = _unanswered(replies)
    problems = [
        f"{reply.label}: {problem}"
        for request, reply in zip(requests, replies, strict=True)
        if (problem := tool_call_problem(request, reply)) is not None
    ]
    return _percent(
        "tool_calls", spec.min_score, len(requests), problems, "valid", started, failure
    )
