import re
from pathlib import Path

import pytest

from sparkdeploy.errors import RecipeError
from sparkdeploy.spec.recipe import DEFAULT_READINESS_TIMEOUT_S, RepoRef
from sparkdeploy.spec.recipe_loading import load_all_recipes, load_recipe

ROOT = Path(__file__).parent.parent
RECIPES = ROOT / "recipes"
DSV41 = RECIPES / "dsv41-flash-eugr-0913-4x" / "recipe.toml"
GLM53 = RECIPES / "glm53-flash-r27-dflash2" / "recipe.toml"
BAD = Path(__file__).parent / "fixtures" / "bad" / "recipes"


def test_dsv41_seed_derived_facts() -> None:
    recipe = load_recipe(DSV41)
    assert recipe.recipe_id == "dsv41-flash-eugr-0913-4x"
    assert recipe.served_model_name == "dsv41"
    assert recipe.api_port == 8000
    assert recipe.readiness_timeout_s == DEFAULT_READINESS_TIMEOUT_S
    assert recipe.blocked_reason is None
    assert recipe.nccl_profile == "ds4"
    assert recipe.hf_repos == [RepoRef(repo="deepseek-ai/DeepSeek-V4.1-Flash")]
    assert (
        recipe.vllm_args.value("--engram-config") == '{"cpu_offload":false,"table_memory":"disk"}'
    )
    assert recipe.speculative_model is None  # dspark drafts live inside the target checkpoint


def test_glm53_recipe_is_blocked_with_markers_and_smoke_options() -> None:
    recipe = load_recipe(GLM53)
    assert recipe.served_model_name == "glm53"
    assert recipe.readiness_timeout_s == 3600.0
    assert recipe.blocked_reason is not None
    assert "GLM MLA parent-page stride must be an exact number of C4 pages" in recipe.blocked_reason
    assert [repo.repo for repo in recipe.hf_repos] == [
        "local-inference-lab/GLM-5.3-Flash-NVFP4",
        "incoai/GLM-5.3-Flash-DFlash2",  # the --speculative-config drafter
    ]
    assert recipe.smoke.chat_template_kwargs == {"reasoning_effort": "low"}
    quantprobe_ok, quantprobe_broken = recipe.boot_markers[1], recipe.failure_markers[0]
    line_ok = "[quantprobe] layer 45 mtp experts algo=MXFP8"
    line_broken = "[quantprobe] layer 45 mtp experts algo=None"
    assert [m.name for m in recipe.boot_markers][0::3] == ["weights loaded", "API up"]
    assert re.search(quantprobe_ok.pattern, line_ok)
    assert not re.search(quantprobe_ok.pattern, line_broken)
    assert re.search(quantprobe_broken.pattern, line_broken)
    assert not re.search(quantprobe_broken.pattern, line_ok)


def test_blocked_name_without_key_takes_the_header_reason(tmp_path: Path) -> None:
    text = GLM53.read_text()
    start = text.index('blocked = """')
    end = text.index('"""', start + len('blocked = """')) + 3
    path = tmp_path / "glm" / "recipe.toml"
    path.parent.mkdir()
    path.write_text(text[:start] + text[end:])
    reason = load_recipe(path).blocked_reason
    assert reason is not None
    assert reason.startswith("BLOCKED 2026-09-06 (night shift): the DFlash2 drafter inherits")
    assert reason.endswith("See specs/tech-architecture/glm53-recipe-state.md.")


def test_load_all_recipes_by_name() -> None:
    recipes = load_all_recipes(RECIPES)
    assert {"dsv41-flash-eugr-0913-4x", "glm53-flash-r27-dflash2"} <= set(recipes)
    assert all(name == recipe.recipe_id for name, recipe in recipes.items())


def test_load_all_recipes_reports_every_broken_file(tmp_path: Path) -> None:
    for name in ("duplicate-key", "bad-json"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "recipe.toml").write_text((BAD / f"{name}.toml").read_text())
    with pytest.raises(RecipeError) as caught:
        load_all_recipes(tmp_path)
    lines = str(caught.value).splitlines()
    assert len(lines) == 2
    assert "bad-json/recipe.toml:10: --speculative-config: invalid JSON" in lines[0]
    assert "duplicate-key/recipe.toml:8:1: key 'model' is set twice" in lines[1]


# Each malformed recipe: the fragments its error must contain (place, what is wrong, the fix).
BAD_RECIPES = {
    "../glm53-seed-verbatim": [":94:8:", "string opened on line 94 is never closed", 'closing "'],
    "unknown-key-typo": [":8:", "unknown key 'tensor_paralel_size'", "'tensor_parallel_size'?"],
    "unknown-nested-key": [
        ":17:",
        "'composed_model.sources[0].revison'",
        "did you mean 'revision'",
    ],
    "smoke-typo": [":13:", "'smoke.chat_template_kwarg'", "did you mean 'chat_template_kwargs'"],
    "missing-model": ["missing-model.toml: model:", "required key is missing: add it"],
    "wrong-type-nodes": [":5: required_nodes:", "valid integer", "write it without quotes"],
    "env-not-string": [":13: env.OMP_NUM_THREADS:", "must be a string: quote it"],
    "bad-backend": [":7: distributed_backend:", "should be 'mp'", "'nccl'"],
    "bad-repo-id": [":4: model:", "not a Hugging Face repo id", "'org/name'"],
    "bad-json": [":10: --speculative-config: invalid JSON at char 46", "fix the JSON"],
    "json-flag-without-value": [":10: --kernel-config", "needs a JSON value"],
    "duplicate-flag": [":11: --max_model_len is given twice", "duplicate-flag.toml:9)", "keep one"],
    "stray-value": [":9: stray value 'lab/tiny-model'", "the model goes in `model`"],
    "quoted-non-json": [":9: --served-model-name", "single quotes", "remove them"],
    "plan-flag-in-args": [":10: --tensor-parallel-size", "tensor_parallel_size", "remove it"],
    "revision-flag": [":10: --revision", "model_revision", "remove it from args"],
    "backend-mismatch": [":9: --distributed-executor-backend uni", '"mp"', "make them agree"],
    "ray-backend": [':7: distributed_backend: "ray" is refused', "mp is the supported backend"],
    "env-per-node": [":14: env.VLLM_HOST_IP", "set per node", "remove it"],
    "bad-timeout": [":13: env.VLLM_ENGINE_READY_TIMEOUT_S 'soon'", "positive number of seconds"],
    "bad-regex": [":14: boot_markers[0].pattern", "not a valid regular expression", "backslash"],
    "relative-mount": [":13: extra_mounts[0].host 'cache/vllm'", "start with ~/"],
    "tp-not-divisible": [":5: required_nodes = 3 does not divide", "= 4"],
    "conflicting-revisions": [":8:", "lab/tiny-model is pinned to two revisions", "pin one"],
    "empty-blocked": [":8: blocked is empty", "say why"],
    "duplicate-key": [":8:1: key 'model' is set twice (first on line 4)", "keep one"],
    "missing-equals": [":8:10: expected `=` after the key"],
    "unterminated-array": [":3:8: the array opened on line 3 is never closed", "before the table"],
    "unclosed-multiline-json": [":3:29: the multi-line string opened on line 3", 'add """'],
}


@pytest.mark.parametrize("name", sorted(BAD_RECIPES))
def test_malformed_recipe_message(name: str) -> None:
    path = BAD / f"{name}.toml"
    with pytest.raises(RecipeError) as caught:
        load_recipe(path)
    message = str(caught.value)
    assert message.startswith(str(path))
    for fragment in BAD_RECIPES[name]:
        assert fragment in message
