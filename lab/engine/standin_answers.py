"""What the stand-in "model" says: deterministic answers (the field's canaries right), reasoning,
tool calls, and the broken outputs the fault switches ask for. Pure functions.

A token here is a word or a punctuation mark with its leading whitespace, so that joining the
tokens of a text gives the text back and streaming sends one token per chunk.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

_TOKEN = re.compile(r"\s*(?:\w+|[^\w\s])")
_OPERATORS = {
    "*": "*",
    "x": "*",
    "×": "*",
    "times": "*",
    "multiplied by": "*",
    "+": "+",
    "plus": "+",
    "-": "-",
    "minus": "-",
}
_ARITHMETIC = re.compile(
    r"(-?\d+)\s*(multiplied by|times|plus|minus|[*x×+\-])\s*(-?\d+)", re.IGNORECASE
)
_FIB_CALL = re.compile(r"\bfib(?:onacci)?\s*(?:number\s*)?\(\s*(\d+)\s*\)", re.IGNORECASE)
_FIB_ORDINAL = re.compile(r"\b(\d+)(?:st|nd|rd|th)\s+fibonacci", re.IGNORECASE)
_FIB_OF = re.compile(r"fibonacci\s+(?:number\s+)?(?:of\s+|for\s+|n\s*=\s*)?(\d+)", re.IGNORECASE)
_QUOTED = re.compile(r"[\"'“‘`]([^\"'”’`\s]+)[\"'”’`]")
_REVERSE_WORD = re.compile(
    r"revers\w*\s+(?:the\s+)?(?:word|string|letters of)?\s*:?\s*(\w+)", re.IGNORECASE
)

REASONING_STEPS = (
    "Read the question and note what is asked.",
    "Work out the answer from what the question gives.",
    "Check the result once more.",
    "Write the answer briefly.",
)
# Reasoning tokens per effort; GLM's template thinks at maximum effort unless told otherwise.
EFFORT_TOKENS = {"none": 0, "low": 16, "medium": 48, "high": 160, "max": 1200}
MAX_EFFORT_PARSERS = ("glm45",)
TOOL_CHOICE_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


def count_tokens(text: str) -> int:
    return len(tokens(text))


def fibonacci(n: int) -> int:
    previous, current = 0, 1
    for _ in range(n):
        previous, current = current, previous + current
    return previous


def canary_answer(prompt: str) -> str | None:
    """The right answer to an arithmetic, Fibonacci or word-reversal question, if it is one."""
    for pattern in (_FIB_CALL, _FIB_ORDINAL, _FIB_OF):
        match = pattern.search(prompt)
        if match and int(match.group(1)) <= 10_000:
            n = int(match.group(1))
            return f"Fib({n}) = {fibonacci(n)}."
    if re.search(r"revers|backward", prompt, re.IGNORECASE):
        match = _QUOTED.search(prompt) or _REVERSE_WORD.search(prompt)
        if match:
            word = match.group(1)
            return f'"{word}" reversed is "{word[::-1]}".'
    match = _ARITHMETIC.search(prompt)
    if match:
        left, operator, right = int(match.group(1)), match.group(2).lower(), int(match.group(3))
        symbol = _OPERATORS[operator]
        result = {"*": left * right, "+": left + right, "-": left - right}[symbol]
        return f"{left} {symbol} {right} = {result}."
    return None


REPEAT_REQUEST = re.compile(
    r"^Repeat the following sentence exactly[^\n]*\n(?P<sentence>.+)$", re.S
)


def fixed_answer(prompt: str) -> str | None:
    """The one right reply to a canary, or the sentence the prompt asks to repeat; None for a
    prompt whose reply is free text."""
    canary = canary_answer(prompt)
    if canary is not None:
        return canary
    repeat = REPEAT_REQUEST.match(prompt.strip())
    return repeat.group("sentence").strip() if repeat is not None else None


def picture_answer(colours: Sequence[str]) -> str:
    """What the request's pictures show (standin_images.seen_colour names each one's colour)."""
    if len(colours) == 1:
        return f"The image is {colours[0]}."
    return f"The images are {', '.join(colours[:-1])} and {colours[-1]}."


def answer(prompt: str) -> str:
    """The stand-in's reply: a canary's answer, a sentence it was asked to repeat, or a reply
    naming the prompt's topics."""
    fixed = fixed_answer(prompt)
    if fixed is not None:
        return fixed
    topics: list[str] = []
    for word in re.findall(r"[A-Za-z]{4,}", prompt):
        if word.lower() not in topics:
            topics.append(word.lower())
    if not topics:
        return "Hello! How can I help you today?"
    return (
        f"You asked about {', '.join(topics[:5])}. This reply comes from the lab's engine "
        "stand-in, which answers every prompt deterministically."
    )


def reasoning_budget(parser: str | None, template_kwargs: Mapping[str, Any]) -> int:
    if parser is None or template_kwargs.get("enable_thinking") is False:
        return 0
    effort = template_kwargs.get("reasoning_effort")
    if effort is None:
        effort = "max" if parser in MAX_EFFORT_PARSERS else "medium"
    return EFFORT_TOKENS.get(str(effort), EFFORT_TOKENS["max"])


def reasoning(prompt: str, budget: int) -> str:
    """Thinking of about `budget` tokens that restates the prompt, then numbered steps."""
    if budget <= 0:
        return ""
    head = " ".join(prompt.split()[:8])
    parts = [f"The user asks: {head.rstrip('.?!')}."]
    step = 0
    while sum(count_tokens(part) for part in parts) < budget:
        parts.append(f"Step {step + 1}: {REASONING_STEPS[step % len(REASONING_STEPS)]}")
        step += 1
    return " ".join(parts)


def garble(text: str) -> str:
    """The text as a broken quantized LM head writes it: letters swapped, digits off, mojibake."""

    def word(match: re.Match[str]) -> str:
        chars = list(match.group(0))
        for i in range(1, len(chars) - 1, 2):
            chars[i], chars[i + 1] = chars[i + 1], chars[i]
        return "".join(chars) + ("Ã" if len(chars) > 3 else "")

    swapped = re.sub(r"[A-Za-z]+", word, text)
    return re.sub(r"\d", lambda m: str((int(m.group(0)) + 7) % 10), swapped)


def misspell(text: str) -> str:
    """The text with every second word of five letters or more misspelled, two neighbouring
    inner letters swapped ("answers" -> "answres"), as a build whose LM head mixes up close
    tokens writes it: words no dictionary has, yet nothing like garbage."""
    long_words = 0

    def word(match: re.Match[str]) -> str:
        nonlocal long_words
        letters = match.group(0)
        long_words += 1
        if long_words % 2:
            return letters
        for i in range(len(letters) // 2, len(letters) - 2):
            if letters[i] != letters[i + 1]:
                return letters[:i] + letters[i + 1] + letters[i] + letters[i + 2 :]
        return letters

    return re.sub(r"[A-Za-z]{5,}", word, text)


def past_eos(text: str, budget: int) -> str:
    """The text and what a model writes after it when its end-of-sequence token is ignored
    (a request's `ignore_eos`): more sentences, past `budget` tokens, so max_tokens ends it."""
    parts = [text] if text else []
    step = 0
    while sum(count_tokens(part) for part in parts) <= budget:
        parts.append(REASONING_STEPS[step % len(REASONING_STEPS)])
        step += 1
    return " ".join(parts)


def token_loop(budget: int) -> str:
    """A degenerate repetition like a broken FP4 MoE kernel's: one phrase until max_tokens."""
    phrase = " of the"
    return ("The answer" + phrase * max(1, budget // 2)).strip()


def choose_tool(
    tools: Sequence[Mapping[str, Any]], tool_choice: Any, prompt: str
) -> Mapping[str, Any]:
    functions: list[Mapping[str, Any]] = [
        function
        for tool in tools
        if isinstance(tool, Mapping) and isinstance(function := tool.get("function", {}), Mapping)
    ]
    if isinstance(tool_choice, Mapping):
        wanted = tool_choice.get("function", {}).get("name")
        for function in functions:
            if function.get("name") == wanted:
                return function
    words = set(re.findall(r"[a-z]+", prompt.lower()))
    for function in functions:
        name_words = set(re.findall(r"[a-z]+", str(function.get("name", "")).lower()))
        if name_words & words:
            return function
    return functions[0] if functions else {"name": "unknown", "parameters": {}}


def tool_arguments(function: Mapping[str, Any], prompt: str) -> str:
    """JSON arguments for the function's required parameters, drawn from the prompt."""
    parameters = function.get("parameters") or {}
    properties: Mapping[str, Any] = parameters.get("properties") or {}
    required = parameters.get("required") or list(properties)
    # The prompt's first word is capitalized for grammar, not because it names something.
    capitalized = re.findall(r"\b[A-Z][a-z]+\b", prompt)[1:]
    words = re.findall(r"[A-Za-z]+", prompt)
    numbers = re.findall(r"-?\d+(?:\.\d+)?", prompt)
    arguments: dict[str, Any] = {}
    for name in required:
        schema = properties.get(name, {})
        kind = schema.get("type", "string")
        if "enum" in schema:
            arguments[name] = schema["enum"][0]
        elif kind in ("integer", "number"):
            value = float(numbers[0]) if numbers else 1
            arguments[name] = int(value) if kind == "integer" else value
        elif kind == "boolean":
            arguments[name] = True
        elif kind == "array":
            arguments[name] = []
        elif kind == "object":
            arguments[name] = {}
        else:
            arguments[name] = (capitalized or words or ["value"])[-1]
    return json.dumps(arguments)
