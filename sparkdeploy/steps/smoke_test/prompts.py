"""What the smoke test asks, and the answers it must get: the canaries (a question at temperature 0
with one right answer), the long prompt, the streaming prompt, the sentence to copy, the tool.

lab/chat_lessons.py teaches the lab's chat model for real vLLM exactly these prompts, with
answers these checks accept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sparkdeploy.steps.smoke_test.detectors import numbers_in, words_in


@dataclass(frozen=True)
class Canary:
    name: str
    prompt: str
    expected: str
    is_answer: Callable[[str], bool]


def _has_number(expected: str) -> Callable[[str], bool]:
    return lambda content: expected in numbers_in(content)


def _has_word(expected: str) -> Callable[[str], bool]:
    return lambda content: expected in (word.lower() for word in words_in(content))


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
