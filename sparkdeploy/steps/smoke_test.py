"""The smoke test: does the endpoint answer, and answer well?

Requests, in this order (the order matters: a fault that starts at the 5th-6th request must land
in the burst, after the canaries passed): the three canaries at temperature 0, a burst of
sequential canary requests, a prompt over 64 tokens, a streaming request with usage (TTFT and
decode tok/s), an exact-copy request, a tool call when auto tool choice is on. Every reply then
goes through the detectors (token loops, garbled text, empty content). Each check has a name,
passed, evidence and figures; one failed check fails the report.

The detectors are pure functions of a text, so they are tested on literal examples.
"""

from __future__ import annotations

import difflib
import http.client
import json
import re
import time
import unicodedata
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import SecretStr

from sparkdeploy.errors import SmokeFailed
from sparkdeploy.remote import engine_http
from sparkdeploy.vllm import metrics as engine_metrics
from sparkdeploy.vllm.metrics import EngineFigure

# ---------------------------------------------------------------------------------------------
# Detectors (pure)

_TOKEN = re.compile(r"\w+|[^\w\s]")
_WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)*")
LOOP_NGRAM = 4
LOOP_MIN_TOKENS = 16
LOOP_TAIL_TOKENS = 48
LOOP_RATIO = 0.5
# Text without spaces (a loop of one long token, CJK) is judged on characters.
LOOP_CHAR_NGRAM = 8
LOOP_MIN_CHARS = 64

GARBLED_MIN_WORDS = 10
GARBLED_ODD_WORD_RATIO = 0.15
SALAD_MIN_WORDS = 20
SALAD_FUNCTION_WORD_RATIO = 0.12
# UTF-8 read as Latin-1/cp1252 ("Ã©", "â€™", "Â°"), or a Latin-1 capital stuck to a lowercase
# word ("wordÃ"): never in a healthy model's English.
_MOJIBAKE = re.compile(r"Ã[\u0080-\u00bf]|â€|Â[\u00a0-\u00bf]|[a-zß-ÿ][À-Þ]")
MOJIBAKE_MIN_HITS = 2
_VOWELS = set("aeiouyàáâäèéêëìíîïòóôöùúûü")
# English prose is about 40 % these words; token salad from a broken LM head has almost none.
FUNCTION_WORDS = frozenset(
    """a about above after again against all also an and any are as at be because been before
    being below between both but by can could did do does doing down during each few for from
    further had has have having he her here hers herself him himself his how i if in into is it
    its itself just me more most my myself no nor not now of off on once only or other our ours
    out over own same she should so some such than that the their theirs them then there these
    they this those through to too under until up very was we were what when where which while
    who whom why will with would you your yours""".split()  # noqa: SIM905 (a list would be 120 lines)
)


def repeated_ngram_ratio(tokens: Sequence[str], n: int) -> float:
    """Share of the n-grams of `tokens` that repeat an earlier one: 0 for fresh text, ~1 for a
    loop."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def detect_repetition(text: str) -> str | None:
    """Evidence of a degenerate loop in `text`, or None.

    Judged on word-level 4-grams over the whole text and over its tail (a loop that starts late
    in a long answer), or on character 8-grams when the text has few word boundaries.
    """
    tokens = [token.lower() for token in _TOKEN.findall(text)]
    if len(tokens) >= LOOP_MIN_TOKENS:
        for scope, window in (("reply", tokens), ("tail", tokens[-LOOP_TAIL_TOKENS:])):
            ratio = repeated_ngram_ratio(window, LOOP_NGRAM)
            if ratio >= LOOP_RATIO:
                gram, count = Counter(
                    tuple(window[i : i + LOOP_NGRAM]) for i in range(len(window) - LOOP_NGRAM + 1)
                ).most_common(1)[0]
                return (
                    f"token loop: {ratio:.0%} of the {scope}'s {LOOP_NGRAM}-grams repeat; "
                    f"{' '.join(gram)!r} x{count}"
                )
        return None
    stripped = "".join(text.split())
    if len(stripped) >= LOOP_MIN_CHARS:
        ratio = repeated_ngram_ratio(stripped, LOOP_CHAR_NGRAM)
        if ratio >= LOOP_RATIO:
            compressed = len(zlib.compress(stripped.encode())) / len(stripped.encode())
            return (
                f"character loop: {ratio:.0%} of {LOOP_CHAR_NGRAM}-character runs repeat "
                f"(compresses to {compressed:.0%})"
            )
    return None


def _script(char: str) -> str:
    name = unicodedata.name(char, "")
    return name.split(" ", 1)[0] if name else "UNKNOWN"


def odd_word_reason(word: str) -> str | None:
    """Why `word` cannot be a word of natural text, or None. Rules, not a dictionary."""
    if any(char == "\ufffd" or unicodedata.category(char) in ("Co", "Cn", "Cs") for char in word):
        return "broken character"
    letters = [char for char in word if char.isalpha()]
    if len({_script(char) for char in letters}) > 1:
        return "mixed scripts"
    if not all(char.isascii() for char in letters):
        return None
    lower = word.lower()
    if re.search(r"(.)\1\1", lower):
        return "letter tripled"
    if len(lower) >= 4 and not _VOWELS.intersection(lower) and not word.isupper():
        return "no vowel"
    if re.search(r"[^aeiouy'’]{6}", lower):
        return "six consonants in a row"
    if re.fullmatch(r"[a-z]+[A-Z]+[a-z]+[A-Z]+.*", word):
        return "case flips inside the word"
    return None


def function_word_ratio(words: Sequence[str]) -> float:
    if not words:
        return 0.0
    return sum(word.lower() in FUNCTION_WORDS for word in words) / len(words)


def detect_garbled(text: str) -> str | None:
    """Evidence that `text` is garbled (broken characters, mojibake, non-words, word salad)."""
    if "\ufffd" in text:
        return f"{text.count(chr(0xFFFD))} replacement character(s) (U+FFFD): broken decoding"
    mojibake = _MOJIBAKE.findall(text)
    if len(mojibake) >= MOJIBAKE_MIN_HITS:
        return f"mojibake: {len(mojibake)} encoding artefacts like {mojibake[:3]}"
    words = _WORD.findall(text)
    if len(words) < GARBLED_MIN_WORDS:
        return None
    odd = [(word, reason) for word in words if (reason := odd_word_reason(word))]
    ratio = len(odd) / len(words)
    if ratio >= GARBLED_ODD_WORD_RATIO:
        examples = ", ".join(f"{word!r} ({reason})" for word, reason in odd[:4])
        return f"{ratio:.0%} of {len(words)} words are not words: {examples}"
    if len(words) >= SALAD_MIN_WORDS:
        share = function_word_ratio(words)
        if share < SALAD_FUNCTION_WORD_RATIO:
            return (
                f"word salad: only {share:.0%} of {len(words)} words are English function words "
                f"(prose has ~40%): {' '.join(words[:8])!r}..."
            )
    return None


def copy_mismatches(expected: str, reply: str) -> list[str]:
    """Words of `expected` the reply changed or dropped, as "'was' -> 'now'" strings.

    Words before and after the copy ("Sure, here it is: ...") do not count.
    """
    want = [word.lower() for word in _WORD.findall(expected)]
    got = [word.lower() for word in _WORD.findall(reply)]
    matcher = difflib.SequenceMatcher(a=want, b=got, autojunk=False)
    return [
        f"{' '.join(want[a0:a1])!r} -> {' '.join(got[b0:b1])!r}"
        for tag, a0, a1, b0, b1 in matcher.get_opcodes()
        if tag != "equal" and not (tag == "insert" and a0 in (0, len(want)))
    ]


def copied_share(expected: str, reply: str) -> float:
    """Share of the words of `expected` that the reply has, in order."""
    want = [word.lower() for word in _WORD.findall(expected)]
    got = [word.lower() for word in _WORD.findall(reply)]
    matcher = difflib.SequenceMatcher(a=want, b=got, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks()) / max(len(want), 1)


def numbers_in(text: str) -> list[str]:
    return [number.replace(",", "") for number in re.findall(r"-?\d[\d,]*", text)]


# ---------------------------------------------------------------------------------------------
# Canaries and prompts


@dataclass(frozen=True)
class Canary:
    name: str
    prompt: str
    expected: str
    is_answer: Callable[[str], bool]


def _has_number(expected: str) -> Callable[[str], bool]:
    return lambda content: expected in numbers_in(content)


def _has_word(expected: str) -> Callable[[str], bool]:
    return lambda content: expected in (word.lower() for word in _WORD.findall(content))


CANARIES: tuple[Canary, ...] = (
    Canary(
        "canary_multiply",
        "What is 127*43? Answer with the number only.",
        "5461",
        _has_number("5461"),
    ),
    Canary(
        "canary_fibonacci",
        "What is Fib(10), the 10th Fibonacci number (Fib(1) = Fib(2) = 1)? "
        "Answer with the number only.",
        "55",
        _has_number("55"),
    ),
    Canary(
        "canary_reverse",
        'Write the word "accuracy" reversed, letter by letter. Answer with the reversed word only.',
        "ycarucca",
        _has_word("ycarucca"),
    ),
)

LONG_PROMPT_MIN_TOKENS = 64
LONG_PROMPT = (
    "Read this note from a lighthouse keeper, then answer the question after it.\n\n"
    "The keeper climbs the spiral stairs of the tower every evening an hour before sunset. He "
    "trims the wick, polishes the brass and the great glass lens, winds the clockwork that turns "
    "the light, and writes the weather in the log: the wind's direction and strength, the height "
    "of the swell, whether fog is rolling in from the sea. On foggy nights he also starts the "
    "horn, which sounds twice every thirty seconds until the morning. Ships that pass count the "
    "flashes of the beam to tell this lighthouse from the next one along the coast, because each "
    "light along the coast has its own pattern of flashes. In the morning he puts out the lamp, "
    "closes the curtains so the sun cannot crack the lens, and rows to the village for supplies "
    "and letters.\n\n"
    "Question, unrelated to the note: what is 127*43? Answer with the number only."
)
STREAM_PROMPT = "In three sentences, explain how a lighthouse helps ships at night."
COPY_SENTENCE = (
    "The lighthouse keeper carefully polished the enormous brass lantern every evening before "
    "sunset."
)
# Below this share of the sentence's words the reply is no copy at all, not a copy with typos.
COPY_MIN_SHARE = 0.5
COPY_PROMPT = f"Repeat the following sentence exactly, with no other text:\n{COPY_SENTENCE}"
TOOL_PROMPT = "Use the get_weather tool: what is the weather in Paris right now?"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}


# ---------------------------------------------------------------------------------------------
# Requests


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
    burst_size: int = 8
    max_tokens: int = 1024
    request_timeout_s: float = 120.0


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


def _request_body(settings: SmokeSettings, prompt: str, **fields: Any) -> dict[str, Any]:
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


def chat(settings: SmokeSettings, label: str, prompt: str, **fields: Any) -> Reply:
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


# ---------------------------------------------------------------------------------------------
# Checks and the report


@dataclass(frozen=True)
class SmokeCheck:
    name: str
    passed: bool
    evidence: str
    figures: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SmokeReport:
    base_url: str
    served_model_name: str
    checks: list[SmokeCheck]
    # What the engine's /metrics says the smoke requests did, beside our own count (informative:
    # another client's requests in the meantime count too).
    engine: list[EngineFigure] = field(default_factory=list)
    engine_error: str | None = None  # why there are no engine figures
    head_node: str = ""

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def failed(self) -> list[SmokeCheck]:
        return [check for check in self.checks if not check.passed]

    def check(self, name: str) -> SmokeCheck:
        return next(check for check in self.checks if check.name == name)

    def table_rows(self) -> list[dict[str, str]]:
        """Rows for a Prefect table artifact: the checks, then the engine's own figures."""
        rows = [
            {
                "check": check.name,
                "result": "pass" if check.passed else "FAIL",
                "evidence": check.evidence,
                "figures": ", ".join(f"{key}={value:g}" for key, value in check.figures.items()),
            }
            for check in self.checks
        ]
        engine = [(f"engine /metrics: {figure.name}", figure.text()) for figure in self.engine]
        if self.engine_error:
            engine.append(("engine /metrics", self.engine_error))
        rows += [
            {"check": name, "result": "info", "evidence": evidence, "figures": ""}
            for name, evidence in engine
        ]
        return rows

    def raise_if_failed(self) -> None:
        if self.passed:
            return
        lines = "\n".join(f"  {check.name}: {check.evidence}" for check in self.failed)
        raise SmokeFailed(
            f"smoke test of {self.served_model_name!r} at {self.base_url}"
            + (f" (head node {self.head_node})" if self.head_node else "")
            + " failed "
            f"{len(self.failed)} of {len(self.checks)} checks:\n{lines}\n"
            "fix: the evidence names the failure mode (docs/field.md, 'Silent failure modes'); "
            "keep the deployment up to inspect it, or compare with the recipe's last good image"
        )


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


def run_smoke(settings: SmokeSettings) -> SmokeReport:
    """Every check against the endpoint; never raises for a bad engine (see raise_if_failed)."""
    checks: list[SmokeCheck] = []
    replies: list[Reply] = []
    before = engine_metrics.scrape(settings.base_url)

    canary_replies = [chat(settings, canary.name, canary.prompt) for canary in CANARIES]
    checks += [_canary_check(c, r) for c, r in zip(CANARIES, canary_replies, strict=True)]
    replies += canary_replies

    burst = [
        (canary, chat(settings, f"burst {index + 1} ({canary.name})", canary.prompt))
        for index in range(settings.burst_size)
        for canary in (CANARIES[index % len(CANARIES)],)
    ]
    checks.append(_burst_check(burst, first_request=len(replies) + 1))
    replies += [reply for _, reply in burst]

    long_reply = chat(settings, "long_prompt", LONG_PROMPT)
    checks.append(_long_prompt_check(long_reply))
    streamed = chat_stream(settings, "streaming", STREAM_PROMPT)
    checks.append(_stream_check(streamed))
    copy_reply = chat(settings, "exact_copy", COPY_PROMPT)
    checks.append(_copy_check(copy_reply))
    replies += [long_reply, streamed.reply, copy_reply]

    if settings.tool_calls:
        tool_reply = chat(
            settings, "tool_call", TOOL_PROMPT, tools=[WEATHER_TOOL], tool_choice="auto"
        )
        checks.append(_tool_check(tool_reply))
        replies.append(tool_reply)
    if settings.reasoning:
        checks.append(_reasoning_check(canary_replies))

    checks.append(_detector_check("no_token_loops", replies, _loop_in))
    checks.append(_detector_check("no_garbled_text", replies, _garbled_in))
    checks.append(_detector_check("no_empty_content", replies, _empty_in))
    after = engine_metrics.scrape(settings.base_url)
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
