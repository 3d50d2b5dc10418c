"""Recipe `args` to a clean vLLM argv.

Recipes hold JSON values written as `\"\"\"\\n'{...}'\"\"\"` (a launcher once joined args into a
shell line, so the JSON kept its single quotes). Without a shell those quotes would reach vLLM;
here they are stripped, the JSON is parsed (errors name the flag and the position) and written
back compactly. `--flag=value` and `--flag value` both read as one flag; a flag given twice is an
error, because vLLM silently keeps the last one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sparkdeploy.errors import RecipeError
from sparkdeploy.secrecy import MASK, is_secret_flag

JSON_FLAGS = frozenset(
    {
        "--speculative-config",
        "--compilation-config",
        "--engram-config",
        "--kernel-config",
        "--override-generation-config",
        "--limit-mm-per-prompt",
    }
)

_NEGATIVE_NUMBER = re.compile(r"-\d")
# vLLM's flags as its parser takes them: `--max-num-seqs`, `-tp`, `-O3`, and the dotted keys of a
# JSON flag (`--compilation-config.mode`); anything else fails vLLM's start, after the prefetch.
_FLAG_NAME = re.compile(r"-{1,2}[A-Za-z0-9][A-Za-z0-9_.-]*", re.ASCII)


def canonical_flag(flag: str) -> str:
    """vLLM's parser reads `--max_model_len` as `--max-model-len`; so do we."""
    return flag.replace("_", "-")


def is_flag(token: str) -> bool:
    """`--x`, `-x` and `--x=1` are flags; `-1` and `-0.5` are values."""
    return token.startswith("-") and not _NEGATIVE_NUMBER.match(token)


@dataclass(frozen=True)
class Flag:
    name: str  # as written in the recipe, without any `=value`
    value: str | None  # None for a boolean flag; JSON values compact
    index: int  # position in the recipe's args list, for error messages
    json_value: Any = None

    @property
    def canonical(self) -> str:
        return canonical_flag(self.name)


@dataclass(frozen=True)
class VllmArgs:
    flags: tuple[Flag, ...]

    def argv(self) -> list[str]:
        tokens: list[str] = []
        for flag in self.flags:
            tokens.append(flag.name)
            if flag.value is not None:
                tokens.append(flag.value)
        return tokens

    def find(self, name: str) -> Flag | None:
        wanted = canonical_flag(name)
        return next((flag for flag in self.flags if flag.canonical == wanted), None)

    def value(self, name: str) -> str | None:
        flag = self.find(name)
        return flag.value if flag else None

    def without(self, name: str) -> VllmArgs:
        wanted = canonical_flag(name)
        return VllmArgs(flags=tuple(flag for flag in self.flags if flag.canonical != wanted))


def _json_error_position(text: str, error: json.JSONDecodeError) -> str:
    return (
        f"line {error.lineno} column {error.colno} (char {error.pos})"
        if "\n" in text
        else (f"char {error.pos}")
    )


def _normalise_value(flag: str, raw: str) -> tuple[str, Any]:
    """The value vLLM should get, and the parsed JSON if it is JSON. Raises ValueError."""
    text = raw.strip()
    quoted = len(text) >= 2 and text[0] == text[-1] == "'"
    if quoted:
        text = text[1:-1].strip()
    looks_like_json = text[:1] in ("{", "[")
    if canonical_flag(flag) not in JSON_FLAGS and not (quoted and looks_like_json):
        if quoted:
            raise ValueError(
                f"{flag}: the value {raw!r} is wrapped in single quotes left over from a shell "
                "line; remove them (args are passed without a shell)"
            )
        return raw, None
    try:
        parsed = json.loads(text)
        compact = json.dumps(parsed, separators=(",", ":"), ensure_ascii=False)
    except json.JSONDecodeError as exc:
        snippet = text[max(0, exc.pos - 15) : exc.pos + 15]
        raise ValueError(
            f"{flag}: invalid JSON at {_json_error_position(text, exc)}: {exc.msg} "
            f"(near {snippet!r}); fix the JSON (keys and strings in double quotes)"
        ) from None
    except RecursionError:
        raise ValueError(f"{flag}: the JSON nests too deeply to read; write it flatter") from None
    return compact, parsed


def parse_args(
    args: Sequence[str], where: Callable[[int], str] = lambda index: f"args[{index}]"
) -> tuple[VllmArgs, list[str]]:
    """Recipe args as flags, and every problem, one line each; a flag with a problem is left out.

    `where(i)` names the place of args[i] (file:line when loaded from a file).
    """
    flags: list[Flag] = []
    problems: list[str] = []
    seen: dict[str, Flag] = {}
    after_secret = False  # a stray value after a secret flag is likely a second one: never echoed
    index = 0
    while index < len(args):
        token = args[index]
        start = index
        index += 1
        if not token.strip():
            # An emptied item: vLLM would get "" as a value (or a stray argument).
            problems.append(
                f"{where(start)}: args[{start}] is empty: remove it (or write the value it lost)"
            )
            continue
        if not is_flag(token):
            shown = MASK if after_secret else repr(token)
            problems.append(
                f"{where(start)}: stray value {shown} with no flag before it; args are "
                "`--flag`, `--flag value` or `--flag=value` (the model goes in `model`)"
            )
            continue
        name, has_equals, inline_value = token.partition("=")
        value: str | None
        if has_equals:
            value = inline_value
        elif index < len(args) and args[index].strip() and not is_flag(args[index]):
            value = args[index]
            index += 1
        else:
            value = None
        after_secret = is_secret_flag(name)
        if _FLAG_NAME.fullmatch(name) is None:
            problems.append(f"{where(start)}: {_flag_name_problem(name)}")
            continue
        parsed = None
        if value is not None and not after_secret:  # a secret is passed as written, never echoed
            try:
                value, parsed = _normalise_value(name, value)
            except ValueError as exc:
                problems.append(f"{where(start)}: {exc}")
                continue
        elif canonical_flag(name) in JSON_FLAGS:
            problems.append(f"{where(start)}: {name} needs a JSON value after it")
            continue
        flag = Flag(name=name, value=value, index=start, json_value=parsed)
        earlier = seen.get(flag.canonical)
        if earlier is not None:
            problems.append(
                f"{where(start)}: {name} is given twice (first at {where(earlier.index)}); "
                "keep one (vLLM would silently use the last)"
            )
            continue
        seen[flag.canonical] = flag
        flags.append(flag)
    return VllmArgs(flags=tuple(flags)), problems


def _flag_name_problem(name: str) -> str:
    """Why an args item that starts with '-' is no flag; what follows a space is never quoted
    (`--api-key KEY` written as one item holds a secret there)."""
    first_word = name.split(maxsplit=1)[0] if name.strip() else name
    if first_word != name:
        return (
            f"{first_word!r} and what follows it are one item, and no shell splits args: write "
            f'the flag and its value as items of their own ("{first_word}", "<its value>")'
        )
    return (
        f"{name!r} is not a flag name: vLLM's flags are `--name` or `-x` (ASCII letters, digits, "
        "- _ .); write the flag's value in its own item or after '='"
    )


def normalise_args(
    args: Sequence[str], where: Callable[[int], str] = lambda index: f"args[{index}]"
) -> VllmArgs:
    """Parse recipe args into flags; all problems are reported together in one RecipeError."""
    parsed, problems = parse_args(args, where)
    if problems:
        raise RecipeError("\n".join(problems))
    return parsed


def argv_has_flag(argv: Sequence[str], name: str) -> bool:
    """Whether flag `name` is in a command line (`--flag`, `--flag value` or `--flag=value`, any
    spelling vLLM accepts)."""
    wanted = canonical_flag(name)
    return any(
        is_flag(flag) and canonical_flag(flag) == wanted
        for flag in (token.partition("=")[0] for token in argv)
    )


def argv_flag_value(argv: Sequence[str], name: str) -> str | None:
    """The value of flag `name` in a command line (`--flag value` or `--flag=value`, any
    spelling vLLM accepts), or None when it is absent or has no value."""
    wanted = canonical_flag(name)
    for index, token in enumerate(argv):
        flag, has_equals, inline = token.partition("=")
        if not is_flag(flag) or canonical_flag(flag) != wanted:
            continue
        if has_equals:
            return inline
        following = argv[index + 1] if index + 1 < len(argv) else None
        return following if following is not None and not is_flag(following) else None
    return None


LIMIT_MM_FLAG = "--limit-mm-per-prompt"


def images_per_prompt(argv: Sequence[str]) -> int:
    """The images one prompt may carry by a command line's --limit-mm-per-prompt: its JSON
    `{"image": 2}`, `{"image": {"count": 2, ...}}` (with profiling options) or vLLM's older
    `image=2`; 0 without the flag, whose default depends on the model (unknown here)."""
    value = argv_flag_value(argv, LIMIT_MM_FLAG)
    if value is None:
        return 0
    try:
        limits = json.loads(value)
    except json.JSONDecodeError:
        pairs = (item.partition("=") for item in value.split(","))
        limits = {key.strip(): count.strip() for key, _, count in pairs}
    image = limits.get("image", 0) if isinstance(limits, dict) else 0
    if isinstance(image, dict):
        image = image.get("count", 0)
    try:
        return max(0, int(image))
    except (TypeError, ValueError):
        return 0
