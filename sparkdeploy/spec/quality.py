"""A recipe's [quality] section: the evals a deployment must pass after its smoke test, each
with its threshold (docs/quality.md documents every key and the external evals' contract).

Built in: [quality.typo_rate], [quality.exact_answers], [quality.tool_calls]. External:
[[quality.external]], a command on the ops host or an image run on the head node, whose argv
takes the endpoint, the served model name and the score file's path as whole items.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sparkdeploy.spec.tomlfile import KeyPath, format_key

ENDPOINT = "{endpoint}"
MODEL = "{model}"
SCORE_FILE = "{score_file}"
PLACEHOLDERS = (ENDPOINT, MODEL, SCORE_FILE)
# vLLM's own examples give an OpenAI client this key when the server asks for none.
NO_API_KEY = "EMPTY"
BUILTIN_EVALS = ("typo_rate", "exact_answers", "tool_calls")
# An engine calls tools on its own only with both (vLLM's tool calling docs).
TOOL_CHOICE_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser")

_PATH_STEP = re.compile(r"([^.\[\]]+)((?:\[\d+\])*)")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ENV_NAME_RULE = "letters, digits and _, not first a digit"
# docker's reference grammar (distribution/reference, regexp.go): [host[:port]/]name[:tag][@digest]
# with lowercase name components; an image the grammar refuses fails only at the pull, on a node.
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*(?::[0-9]+)?"
_NAME_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE_REFERENCE = re.compile(
    rf"(?:{_DOMAIN}/)?{_NAME_COMPONENT}(?:/{_NAME_COMPONENT})*"
    r"(?::\w[\w.-]{0,127})?(?:@sha256:[0-9a-f]{64})?",
    re.ASCII,
)
IMAGE_REFERENCE_FORM = (
    "write it as docker takes it, `[registry[:port]/]name[:tag][@sha256:digest]` with a "
    'lowercase name (e.g. "lab/vllm-standin:latest")'
)
_PLACEHOLDER_INSIDE = re.compile(r"\{(endpoint|model|score_file|api_key)\}")
_PLACEHOLDER_LIKE = re.compile(r"\{[a-z_]+\}")

Where = Callable[[KeyPath], str]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class TypoRateEval(_Strict):
    """Long answers to everyday prompts; misspelled words over checked words."""

    max_typo_rate: float = Field(ge=0, le=1)
    samples: int = Field(default=16, ge=1, le=1000)
    max_tokens: int = Field(default=1024, ge=16)
    # 0: greedy, the same answers each run; the serving temperature measures what users get.
    temperature: float = Field(default=0.0, ge=0)


class ExactAnswersEval(_Strict):
    """Questions with one right answer (arithmetic, sequences, spelling); percent right."""

    min_score: float = Field(ge=0, le=100)
    samples: int | None = Field(default=None, ge=1)  # None: every built-in question


class ToolCallsEval(_Strict):
    """Requests that must call a tool; percent whose call names an offered tool with JSON
    arguments that match its schema."""

    min_score: float = Field(ge=0, le=100)
    samples: int | None = Field(default=None, ge=1)  # None: every built-in request


class ExternalEval(_Strict):
    """A tool run against the endpoint; its score read from its stdout or a file."""

    name: str = Field(min_length=1)
    command: list[str] = Field(default_factory=list)
    image: str | None = None  # set: `docker run` on the head node; else a process on the ops host
    api_key_env: str = "OPENAI_API_KEY"
    score_from: Literal["stdout", "file"] = "stdout"
    score_regex: str | None = None
    score_json: str | None = None
    min_score: float | None = None
    max_score: float | None = None
    timeout_s: float = Field(default=1800.0, gt=0)

    @property
    def threshold(self) -> tuple[Literal["min", "max"], float]:
        """Which bound the score must keep, and its value (the file's checks ensure one)."""
        if self.min_score is not None:
            return "min", self.min_score
        return "max", self.max_score if self.max_score is not None else 0.0


class Quality(_Strict):
    typo_rate: TypoRateEval | None = None
    exact_answers: ExactAnswersEval | None = None
    tool_calls: ToolCallsEval | None = None
    external: list[ExternalEval] = Field(default_factory=list)

    @property
    def eval_names(self) -> list[str]:
        """Every eval's name, in the order the quality gate runs them."""
        builtin = [name for name in BUILTIN_EVALS if getattr(self, name) is not None]
        return builtin + [external.name for external in self.external]


def is_env_name(name: str) -> bool:
    """Whether `name` can be an environment variable's name: a POSIX shell's rule, which docker's
    `-e NAME=value` and env files need too (a `=` or a newline would split the entry)."""
    return _ENV_NAME.fullmatch(name) is not None


def image_reference_problem(reference: str) -> str | None:
    """Why `reference` is no docker image reference (None: it is one); shared by the recipe's
    docker_image and an external eval's image."""
    if not reference:
        return "is empty"
    if reference.startswith("-"):
        return "starts with '-', which docker would read as an option"
    # The grammar's longest reference: 255 name characters, a 128-character tag, a digest.
    if len(reference) > 512 or _IMAGE_REFERENCE.fullmatch(reference) is None:
        return "is not an image reference"
    return None


def json_path_steps(path: str) -> list[str | int]:
    """`scores.final_score` -> ["scores", "final_score"]; `results[0].score` -> ["results", 0,
    "score"]. ValueError when `path` is not such a path."""
    steps: list[str | int] = []
    for part in path.split("."):
        match = _PATH_STEP.fullmatch(part)
        if match is None:
            raise ValueError(
                f"{path!r} is not a JSON path: write keys joined by dots, a list's index in "
                "brackets after its key (`results[0].score`)"
            )
        steps.append(match.group(1))
        steps += [int(index) for index in re.findall(r"\d+", match.group(2))]
    return steps


def quality_problems(quality: Quality, tool_calls_enabled: bool, where: Where) -> list[str]:
    """What the types of a [quality] section cannot say; `where` names a key's place."""
    problems = []
    if not quality.eval_names:
        problems.append(
            f"{where(('quality',))}: [quality] names no eval: add [quality.typo_rate], "
            "[quality.exact_answers], [quality.tool_calls] or [[quality.external]] "
            "(docs/quality.md), or remove [quality]"
        )
    if quality.tool_calls is not None and not tool_calls_enabled:
        problems.append(
            f"{where(('quality', 'tool_calls'))}: quality.tool_calls asks for tool calls, which "
            f"the engine makes only with {' and '.join(TOOL_CHOICE_FLAGS)} in args: add them "
            "or remove [quality.tool_calls]"
        )
    seen = set(BUILTIN_EVALS)
    for index, external in enumerate(quality.external):
        at = ("quality", "external", index)
        if external.name in seen:
            problems.append(
                f"{where((*at, 'name'))}: quality.external[{index}].name {external.name!r} is "
                "taken (by a built-in eval or another external one): give each eval its own name"
            )
        seen.add(external.name)
        problems += _external_problems(external, at, where)
    return problems


def _external_problems(external: ExternalEval, at: KeyPath, where: Where) -> list[str]:
    key = format_key(at)
    problems = []
    if not external.command and external.image is None:
        problems.append(
            f"{where((*at, 'command'))}: {key}.command is empty: write the argv to run on the "
            "ops host, or set image to run one on the head node"
        )
    for item_index, item in enumerate(external.command):
        problem = _argv_item_problem(item)
        if problem is not None:
            problems.append(f"{where((*at, 'command', item_index))}: {key}.command: {problem}")
    if external.score_from == "file" and SCORE_FILE not in external.command:
        problems.append(
            f'{where((*at, "score_from"))}: {key}.score_from = "file" but the command is given '
            f'no "{SCORE_FILE}" item: pass it where the tool takes its output file (e.g. '
            f'"--json-file", "{SCORE_FILE}")'
        )
    if (external.score_regex is None) == (external.score_json is None):
        problems.append(
            f"{where(at)}: {key} needs one score parser: score_regex (a regular expression; "
            "its group `score`, else its first group, else the whole match of the last match) "
            "or score_json (a path like `scores.final_score` in the JSON)"
        )
    if external.score_regex is not None:
        try:
            re.compile(external.score_regex)
        except re.error as exc:
            problems.append(
                f"{where((*at, 'score_regex'))}: {key}.score_regex is not a valid regular "
                f"expression ({exc}); in a '...' string TOML keeps backslashes as written"
            )
    if external.score_json is not None:
        try:
            json_path_steps(external.score_json)
        except ValueError as exc:
            problems.append(f"{where((*at, 'score_json'))}: {key}.score_json: {exc}")
    if (external.min_score is None) == (external.max_score is None):
        problems.append(
            f"{where(at)}: {key} needs one threshold: min_score (a score at least this passes) "
            "or max_score (at most this passes)"
        )
    if not is_env_name(external.api_key_env):
        problems.append(
            f"{where((*at, 'api_key_env'))}: {key}.api_key_env {external.api_key_env!r} is not "
            f"an environment variable's name ({ENV_NAME_RULE})"
        )
    image_problem = None if external.image is None else image_reference_problem(external.image)
    if image_problem is not None:
        problems.append(
            f"{where((*at, 'image'))}: {key}.image {external.image!r} {image_problem}: "
            f"{IMAGE_REFERENCE_FORM}"
        )
    return problems


def _argv_item_problem(item: str) -> str | None:
    """Why an argv item of an external eval is wrong, or None."""
    if item == "{api_key}" or "{api_key}" in item:
        return (
            "{api_key} is no placeholder: the API key never goes in an argv (`ps` shows it); "
            "the tool reads it from the variable api_key_env names"
        )
    if item in PLACEHOLDERS:
        return None
    inside = _PLACEHOLDER_INSIDE.search(item)
    if inside is not None:
        return (
            f"{item!r}: {inside.group(0)} is substituted only as a whole argv item: split it "
            f'off into an item of its own (e.g. "--base-url", "{ENDPOINT}")'
        )
    if _PLACEHOLDER_LIKE.fullmatch(item):
        close = difflib.get_close_matches(item, PLACEHOLDERS, n=1)
        hint = f"did you mean {close[0]}?" if close else f"they are {', '.join(PLACEHOLDERS)}"
        return f"{item!r} is no placeholder: {hint}"
    return None
