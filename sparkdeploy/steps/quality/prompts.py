"""What the built-in evals ask: everyday prompts for long answers (the typo rate), questions
with one right answer, and requests that must call one of the offered tools.

They stay the same from run to run, so that two runs' scores compare. The typo prompts ask for
everyday prose, whose words a general word list knows (docs/quality.md#the-word-list: on
technical prose the list's false-positive rate is far higher). lab/chat_lessons.py teaches the
lab's chat model for real vLLM the questions' answers and a paragraph for each typo prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

TYPO_PROMPTS = (
    "Write about 300 words on how a lighthouse keeper spends an ordinary day.",
    "Explain in about 300 words how bread dough rises and bakes in the oven.",
    "Describe in about 300 words how a forest changes over the four seasons of a year.",
    "In about 300 words, tell the story of a small fishing village preparing for a storm.",
    "Explain in about 300 words how honey bees find flowers and turn nectar into honey.",
    "Write about 300 words on why people grow vegetables in their own gardens.",
    "Describe in about 300 words how a river shapes the valley it flows through.",
    "Explain in about 300 words how a bicycle turns pedalling into motion.",
)


@dataclass(frozen=True)
class Question:
    prompt: str
    expected: str
    kind: Literal["number", "word"]


def _number(prompt: str, expected: int) -> Question:
    return Question(f"{prompt} Answer with the number only.", str(expected), "number")


def _reversed(word: str) -> Question:
    return Question(
        f'Write the word "{word}" reversed, letter by letter. Answer with the reversed word only.',
        word[::-1],
        "word",
    )


QUESTIONS = (
    _number("What is 127*43?", 127 * 43),
    _number("What is 38*57?", 38 * 57),
    _number("What is 904*16?", 904 * 16),
    _number("What is 6543+2789?", 6543 + 2789),
    _number("What is 10000-3471?", 10000 - 3471),
    _number("What is 72*72?", 72 * 72),
    _number("What is Fib(10), the 10th Fibonacci number (Fib(1) = Fib(2) = 1)?", 55),
    _number("What is Fib(15), the 15th Fibonacci number (Fib(1) = Fib(2) = 1)?", 610),
    _reversed("accuracy"),
    _reversed("lantern"),
    _reversed("harbour"),
    _reversed("velocity"),
)


def _function(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(properties),
                "additionalProperties": False,
            },
        },
    }


TOOLS = (
    _function(
        "get_weather",
        "Current weather for a city.",
        {"city": {"type": "string", "description": "City name"}},
    ),
    _function(
        "set_timer",
        "Start a kitchen timer.",
        {"minutes": {"type": "integer", "description": "Length of the timer in minutes"}},
    ),
    _function(
        "convert_currency",
        "Convert an amount of money between currencies.",
        {
            "amount": {"type": "number", "description": "The amount to convert"},
            "target": {"type": "string", "enum": ["EUR", "USD", "GBP", "JPY"]},
        },
    ),
    _function(
        "add_reminder",
        "Add a reminder to the user's list.",
        {
            "text": {"type": "string", "description": "What to be reminded of"},
            "priority": {"type": "string", "enum": ["low", "normal", "high"]},
        },
    ),
    _function(
        "lookup_stock",
        "The latest share price of a company listed on a stock exchange.",
        {"symbol": {"type": "string", "description": "Ticker symbol, e.g. AAPL"}},
    ),
)


@dataclass(frozen=True)
class ToolRequest:
    prompt: str
    function: str  # the tool the request must call


TOOL_REQUESTS = (
    ToolRequest("Use the weather tool: what is the weather in Paris right now?", "get_weather"),
    ToolRequest("Use the weather tool: is it raining in Oslo at the moment?", "get_weather"),
    ToolRequest("Start a timer for 12 minutes for the pasta.", "set_timer"),
    ToolRequest("Please set a timer: 45 minutes, for the bread in the oven.", "set_timer"),
    ToolRequest(
        "Convert 250 dollars to euros for me; the currency target is EUR.", "convert_currency"
    ),
    ToolRequest("Add a reminder with high priority to call the plumber Monday.", "add_reminder"),
    ToolRequest("Lookup the stock price of the company with the symbol NVDA.", "lookup_stock"),
    ToolRequest("Lookup the latest stock quote for the ticker MSFT.", "lookup_stock"),
)
