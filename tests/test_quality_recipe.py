"""A recipe's [quality] section: what loads, what the plan carries, and bad sections told by
file:line, key and fix (the same table of edited good files as tests/test_bad_input.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_bad_input import GOOD_RECIPE, Edit, edited, expect_problems

from sparkdeploy.errors import RecipeError
from sparkdeploy.spec.quality import json_path_steps
from sparkdeploy.spec.recipe_loading import load_recipe

QUALITY = """
[quality.typo_rate]
max_typo_rate = 0.002
samples = 8

[quality.exact_answers]
min_score = 90

[[quality.external]]
name = "tool-eval-bench"
command = ["tool-eval-bench", "--json", "--base-url", "{endpoint}", "--model", "{model}"]
api_key_env = "TOOL_EVAL_API_KEY"
score_json = "final_score"
min_score = 88
timeout_s = 3600

[[quality.external]]
name = "lab-answers"
image = "lab/vllm-standin:latest"
command = ["python3", "/opt/standin/answer_eval.py", "--json-file", "{score_file}"]
score_from = "file"
score_regex = 'score": ([\\d.]+)'
max_score = 100
"""
# The first [quality] line of GOOD_RECIPE + QUALITY (after the smoke section's line 33).
Q = 35


def with_quality(text: str = QUALITY) -> Edit:
    return ("max_tokens = 8\n", "max_tokens = 8\n" + text)


def test_a_quality_section_loads_with_its_defaults(tmp_path: Path) -> None:
    path = tmp_path / "recipe.toml"
    path.write_text(edited(GOOD_RECIPE, [with_quality()]))
    quality = load_recipe(path).quality
    assert quality is not None
    assert quality.eval_names == ["typo_rate", "exact_answers", "tool-eval-bench", "lab-answers"]
    assert quality.typo_rate is not None
    assert quality.typo_rate.max_tokens == 1024
    assert quality.exact_answers is not None
    assert quality.exact_answers.samples is None
    bench, lab = quality.external
    assert bench.image is None
    assert bench.score_from == "stdout"
    assert bench.threshold == ("min", 88)
    assert lab.api_key_env == "OPENAI_API_KEY"
    assert lab.threshold == ("max", 100)
    assert lab.timeout_s == 1800


def test_a_recipe_without_quality_has_none(tmp_path: Path) -> None:
    path = tmp_path / "recipe.toml"
    path.write_text(GOOD_RECIPE)
    assert load_recipe(path).quality is None


@pytest.mark.parametrize(
    ("path", "steps"),
    [
        ("final_score", ["final_score"]),
        ("scores.final_score", ["scores", "final_score"]),
        ("results[0].score", ["results", 0, "score"]),
        ("a[1][2]", ["a", 1, 2]),
    ],
)
def test_json_paths(path: str, steps: list[str | int]) -> None:
    assert json_path_steps(path) == steps


@pytest.mark.parametrize("path", ["", "a..b", "[0].a", "a[x]", "a[0]b"])
def test_bad_json_paths(path: str) -> None:
    with pytest.raises(ValueError, match="path"):
        json_path_steps(path)  # the message: see test_bad_quality_section


EXTERNAL = '[[quality.external]]\nname = "bench"\n'
TOOL_FLAGS = (
    '"--served-model-name", "tiny",',
    '"--served-model-name", "tiny", "--enable-auto-tool-choice", "--tool-call-parser", "x",',
)

# name: (edits, fragments; a list of fragments per problem)
CASES: dict[str, tuple[list[Edit], list[list[str]]]] = {
    "no-eval": (
        [with_quality("\n[quality]\n")],
        [[f":{Q}: [quality] names no eval", "[quality.typo_rate]", "or remove [quality]"]],
    ),
    "table-typo": (
        [with_quality("\n[quality.typo_rates]\nmax_typo_rate = 0.01\n")],
        [[f":{Q}: unknown key 'quality.typo_rates'", "did you mean 'typo_rate'?"]],
    ),
    "rate-out-of-range": (
        [with_quality("\n[quality.typo_rate]\nmax_typo_rate = 2.0\n")],
        [[f":{Q + 1}: quality.typo_rate.max_typo_rate:", "less than or equal to 1"]],
    ),
    "threshold-key-of-another-eval": (
        [with_quality("\n[quality.exact_answers]\nmax_typo_rate = 0.1\nmin_score = 90\n")],
        [[f":{Q + 1}: unknown key 'quality.exact_answers.max_typo_rate'", "[quality.typo_rate]"]],
    ),
    "tool-calls-without-tool-choice": (
        [with_quality("\n[quality.tool_calls]\nmin_score = 100\n")],
        [[f":{Q}: quality.tool_calls", "--enable-auto-tool-choice and --tool-call-parser"]],
    ),
    "tool-calls-with-tool-choice": (
        [TOOL_FLAGS, with_quality("\n[quality.tool_calls]\nmin_score = 100\n")],
        [],
    ),
    "external-without-command-parser-threshold": (
        [with_quality("\n" + EXTERNAL)],
        [
            [f":{Q}: quality.external[0].command is empty", "set image"],
            [f":{Q}: quality.external[0] needs one score parser", "score_regex", "score_json"],
            [f":{Q}: quality.external[0] needs one threshold", "min_score", "max_score"],
        ],
    ),
    "external-placeholders": (
        [
            with_quality(
                "\n" + EXTERNAL + "command = ['t', '--url={endpoint}', '{api_key}', '{modle}']\n"
                "score_json = 'score'\nmin_score = 1\n"
            )
        ],
        [
            [f":{Q + 2}: quality.external[0].command: '--url={{endpoint}}'", "whole argv item"],
            [f":{Q + 2}: quality.external[0].command: {{api_key}} is no placeholder", "`ps`"],
            [f":{Q + 2}: quality.external[0].command: '{{modle}}'", "did you mean {model}?"],
        ],
    ),
    "external-score-file-not-passed": (
        [
            with_quality(
                "\n" + EXTERNAL + "command = ['t']\nscore_from = 'file'\nscore_json = 'a'\n"
                "max_score = 1\n"
            )
        ],
        [[f':{Q + 3}: quality.external[0].score_from = "file"', '"{score_file}" item']],
    ),
    "external-bad-parsers-name-and-env": (
        [
            with_quality(
                "\n" + EXTERNAL.replace("bench", "typo_rate") + "command = ['t']\n"
                "score_regex = '('\nscore_json = 'a..b'\nmin_score = 1\nmax_score = 2\n"
                "api_key_env = 'API KEY'\nimage = 'a b'\n"
            )
        ],
        [
            [f":{Q}: quality.external[0] needs one score parser"],
            [f":{Q}: quality.external[0] needs one threshold"],
            [f":{Q + 1}: quality.external[0].name 'typo_rate' is taken"],
            [f":{Q + 3}: quality.external[0].score_regex is not a valid regular expression"],
            [f":{Q + 4}: quality.external[0].score_json: 'a..b' is not a JSON path"],
            [f":{Q + 7}: quality.external[0].api_key_env 'API KEY' is not"],
            [f":{Q + 8}: quality.external[0].image 'a b' is not an image reference"],
        ],
    ),
    "external-image-an-option": (
        [
            with_quality(
                "\n" + EXTERNAL + "command = ['t']\nscore_json = 'a'\nmin_score = 1\n"
                "image = '--privileged'\n"
            )
        ],
        [
            [
                f":{Q + 5}: quality.external[0].image '--privileged' starts with '-', which "
                "docker would read as an option: write it as docker takes it"
            ]
        ],
    ),
    "external-timeout-and-unknown-key": (
        [
            with_quality(
                "\n" + EXTERNAL + "command = ['t']\nscore_json = 'a'\nmin_score = 1\n"
                "timeout_s = 0\n"
            )
        ],
        [[f":{Q + 5}: quality.external[0].timeout_s:", "greater than 0"]],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_quality_section(tmp_path: Path, name: str) -> None:
    edits, problems = CASES[name]
    path = tmp_path / "recipe.toml"
    path.write_text(edited(GOOD_RECIPE, edits))
    if problems:
        expect_problems(load_recipe, path, RecipeError, problems)
    else:
        assert load_recipe(path).quality is not None
