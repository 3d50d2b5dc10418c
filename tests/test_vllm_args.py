import json

import pytest

from sparkdeploy.errors import RecipeError
from sparkdeploy.vllm.args import JSON_FLAGS, normalise_args


def test_both_flag_forms_give_the_same_argv() -> None:
    spaced = normalise_args(["--max-model-len", "4096", "--port", "8001"])
    joined = normalise_args(["--max-model-len=4096", "--port=8001"])
    assert spaced.argv() == joined.argv() == ["--max-model-len", "4096", "--port", "8001"]


def test_boolean_flags_and_negative_values() -> None:
    args = normalise_args(["--trust-remote-code", "--seed", "-1", "--enforce-eager"])
    assert [(flag.name, flag.value) for flag in args.flags] == [
        ("--trust-remote-code", None),
        ("--seed", "-1"),
        ("--enforce-eager", None),
    ]


@pytest.mark.parametrize("flag", sorted(JSON_FLAGS))
def test_shell_quoted_json_is_unwrapped_and_compacted(flag: str) -> None:
    # What TOML makes of `"""\n'{...}'"""`: the JSON still in its shell quotes.
    args = normalise_args([flag, '\'{"a": 1, "b": [true, null]}\''])
    assert args.argv() == [flag, '{"a":1,"b":[true,null]}']
    assert args.flags[0].json_value == {"a": 1, "b": [True, None]}


def test_json_in_shell_quotes_is_parsed_for_any_flag() -> None:
    args = normalise_args(["--hf-overrides", '  \'{"rope_scaling": {"factor": 4}}\'\n'])
    assert json.loads(args.argv()[1]) == {"rope_scaling": {"factor": 4}}


def test_json_flag_value_without_quotes_is_validated_too() -> None:
    assert normalise_args(['--limit-mm-per-prompt={"image": 2}']).argv()[1] == '{"image":2}'


def test_invalid_json_names_flag_position_and_fix() -> None:
    with pytest.raises(RecipeError) as caught:
        normalise_args(
            ["--served-model-name", "x", "--engram-config", "'{\"cpu_offload\":false,}'"]
        )
    message = str(caught.value)
    assert message.startswith("args[2]: --engram-config: invalid JSON at char 21: ")
    assert "Expecting property name enclosed in double quotes" in message
    assert "fix the JSON" in message


def test_flag_given_twice_even_spelt_differently() -> None:
    with pytest.raises(RecipeError) as caught:
        normalise_args(["--max-model-len", "1", "--trust-remote-code", "--max_model_len=2"])
    assert str(caught.value) == (
        "args[3]: --max_model_len is given twice (first at args[0]); keep one "
        "(vLLM would silently use the last)"
    )


def test_all_problems_are_reported_with_their_place() -> None:
    with pytest.raises(RecipeError) as caught:
        normalise_args(
            ["model/id", "--served-model-name", "'name'", "--kernel-config"],
            where=lambda index: f"recipe.toml:{10 + index}",
        )
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("recipe.toml:10: stray value 'model/id' with no flag before it")
    assert lines[1].startswith(
        "recipe.toml:11: --served-model-name: the value \"'name'\" is wrapped"
    )
    assert "remove them" in lines[1]
    assert lines[2] == "recipe.toml:13: --kernel-config needs a JSON value after it"


def test_lookup_by_canonical_name() -> None:
    args = normalise_args(["--served_model_name", "dsv41"])
    assert args.value("--served-model-name") == "dsv41"
    assert args.find("--port") is None


@pytest.mark.parametrize(
    ("token", "fragments"),
    [
        ("--max-num-seqs 4", ["args[0]: '--max-num-seqs' and what follows it are one item"]),
        ("--x;id", ["args[0]: '--x;id' is not a flag name", "`--name` or `-x`"]),
        ("--tïny", ["args[0]: '--tïny' is not a flag name"]),
    ],
)
def test_a_flag_name_vllm_has_no_form_for_is_refused(token: str, fragments: list[str]) -> None:
    with pytest.raises(RecipeError) as caught:
        normalise_args([token])
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_a_secret_flag_and_its_value_in_one_item_never_show_the_value() -> None:
    with pytest.raises(RecipeError) as caught:
        normalise_args(["--api-key sk-live-1234", "--port", "8000"])
    assert "sk-live-1234" not in str(caught.value)
    assert str(caught.value).splitlines() == [
        "args[0]: '--api-key' and what follows it are one item, and no shell splits args: write "
        'the flag and its value as items of their own ("--api-key", "<its value>")'
    ]


def test_vllm_flag_forms_pass() -> None:
    args = normalise_args(
        ["-tp", "2", "-O3", "--compilation-config.mode", "3", "--max_model_len=8"]
    )
    assert [flag.name for flag in args.flags] == [
        "-tp",
        "-O3",
        "--compilation-config.mode",
        "--max_model_len",
    ]


def test_json_nested_too_deeply_is_a_problem_not_a_crash() -> None:
    with pytest.raises(RecipeError) as caught:
        normalise_args(["--compilation-config", "[" * 3000 + "]" * 3000])
    assert str(caught.value) == (
        "args[0]: --compilation-config: the JSON nests too deeply to read; write it flatter"
    )
