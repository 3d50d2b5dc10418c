import re
from pathlib import Path

import pytest
from test_bad_input import GOOD_RECIPE, Edit, edited, expect_problems

from sparkdeploy.errors import RecipeError
from sparkdeploy.node.hfcache import relative_path_problem
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


ENV = 'OMP_NUM_THREADS = "2"\n'
IMAGE = 'docker_image = "lab/vllm-standin:latest"'
ARGS = '"--max-model-len", "4096",'
MOVE_UP = "because it follows that table (line 14); move it above the first [table]"
IMAGE_FORM = "`[registry[:port]/]name[:tag][@sha256:digest]` with a lowercase name"
ENV_NAME_RULE = "is not an environment variable's name (letters, digits and _, not first a digit)"
REVISION_FIX = "a revision names a file under the NAS cache's refs/; give a branch, tag or commit"

# name: (edits of tests/test_bad_input.py's good recipe, fragments of each problem in file order)
EDITED_RECIPES: dict[str, tuple[list[Edit], list[list[str]]]] = {
    "top-level-string-after-env": (
        [(ENV, ENV + 'model_revision = "abc"\n')],
        [
            [
                ":16: env.model_revision: a top-level key of the recipe, read as an entry of [env]",
                MOVE_UP,
            ]
        ],
    ),
    "top-level-int-after-env": (
        [(ENV, ENV + "pipeline_parallel_size = 1\n")],
        [[":16: env.pipeline_parallel_size: a top-level key of the recipe", MOVE_UP]],
    ),
    "secret-env-after-env": (
        [(ENV, ENV + 'secret_env = ["OMP_NUM_THREADS"]\n')],
        [[":16: env.secret_env: a top-level key of the recipe", MOVE_UP]],
    ),
    "smoke-key-after-chat-template-kwargs": (
        [
            (
                "[smoke]\nmax_tokens = 8\n",
                "[smoke.chat_template_kwargs]\nenable_thinking = false\nmax_tokens = 8\n"
                'model_revision = "abc"\n',
            )
        ],
        [
            [
                ":34: smoke.chat_template_kwargs.max_tokens: a key of the recipe or of [smoke], "
                "read as an entry of [smoke.chat_template_kwargs] because it follows that table "
                "(line 32)",
                "a [smoke] key above this table's header",
            ],
            [":35: smoke.chat_template_kwargs.model_revision:", "above the first [table]"],
        ],
    ),
    "image-an-option": (
        [(IMAGE, 'docker_image = "--privileged"')],
        [
            [
                ":3: docker_image: '--privileged' starts with '-', which docker would read as an "
                "option",
                IMAGE_FORM,
            ]
        ],
    ),
    "image-empty": (
        [(IMAGE, 'docker_image = ""')],
        [[":3: docker_image: '' is empty", IMAGE_FORM]],
    ),
    "image-with-a-space": (
        [(IMAGE, 'docker_image = "lab/vllm standin"')],
        [[":3: docker_image: 'lab/vllm standin' is not an image reference", IMAGE_FORM]],
    ),
    "image-uppercase-name": (
        [(IMAGE, 'docker_image = "lab/VLLM:latest"')],
        [[":3: docker_image: 'lab/VLLM:latest' is not an image reference"]],
    ),
    "env-names": (
        [(ENV, ENV + '1BAD = "x"\n"A=B" = "y"\n"" = "z"\n"FOO\\n" = "w"\n')],
        [
            # The line scanner keeps a quoted key's escapes, so [env]'s line names this one.
            [":14: env name 'FOO\\n'", ENV_NAME_RULE],
            [":16: env name '1BAD'", ENV_NAME_RULE, "rename it"],
            [":17: env name 'A=B'", ENV_NAME_RULE],
            [":18: env name ''", ENV_NAME_RULE],
        ],
    ),
    "secret-env-name": (
        [(IMAGE, IMAGE + '\nsecret_env = ["A B"]')],
        [[":4: secret_env names 'A B', which", ENV_NAME_RULE, "write the [env] name it means"]],
    ),
    "repo-id-trailing-newline": (
        [('model = "lab/tiny-model"', 'model = "lab/tiny-model\\n"')],
        [[":4: model: 'lab/tiny-model\\n' is not a Hugging Face repo id", "'org/name'"]],
    ),
    "repo-id-unicode": (
        [('model = "lab/tiny-model"', 'model = "lab/tïny-model"')],
        [[":4: model: 'lab/tïny-model' is not a Hugging Face repo id", "ASCII"]],
    ),
    "repo-id-dots": (
        [('model = "lab/tiny-model"', 'model = "lab/.."')],
        [[":4: model: 'lab/..' is not a Hugging Face repo id", "no '--' or '..'"]],
    ),
    "repo-id-double-dash": (
        [('model = "lab/tiny-model"', 'model = "lab/tiny--model"')],
        [[":4: model: 'lab/tiny--model' is not a Hugging Face repo id"]],
    ),
    "shm-size-trailing-newline": (
        [('distributed_backend = "mp"', 'distributed_backend = "mp"\nshm_size = "1gb\\n"')],
        [[":8: shm_size: '1gb\\n' is not a size"]],
    ),
    "port-superscript": (
        [(ARGS, ARGS + ' "--port", "²",')],
        [[":9: --port '²' is not a number from 1 to 65535", "write the port vLLM serves on"]],
    ),
    "port-zero": ([(ARGS, ARGS + ' "--port", "0",')], [[":9: --port '0' is not a number from 1"]]),
    "port-too-big": (
        [(ARGS, ARGS + ' "--port", "99999",')],
        [[":9: --port '99999' is not a number from 1 to 65535"]],
    ),
    "regex-nested-too-deeply": (
        [("'\\[probe\\] algo=None'", "'" + "(" * 3000 + ")" * 3000 + "'")],
        [[":30: failure_markers[0].pattern: the regular expression nests its groups too deeply"]],
    ),
    "revision-empty": (
        [('model = "lab/tiny-model"', 'model = "lab/tiny-model"\nmodel_revision = ""')],
        [[":5: model_revision '' is empty:", REVISION_FIX]],
    ),
    "source-revision-dotdot": (
        [('repo = "lab/tiny-model"', 'repo = "lab/tiny-model"\nrevision = "../../../../etc"')],
        [
            [
                ":21: composed_model.sources[0].revision '../../../../etc' has an empty, '.' or "
                "'..' component",
                REVISION_FIX,
            ]
        ],
    ),
    "parent-revision": (
        [
            (
                'model = "lab/tiny-model"',
                'model = "lab/tiny-model"\nparent_model = "lab/base"\nparent_model_revision = "/x"',
            )
        ],
        [[":6: parent_model_revision '/x' is absolute:", REVISION_FIX]],
    ),
    "entrypoint-one-line": (
        [(IMAGE, IMAGE + '\nentrypoint = ["vllm serve"]')],
        [[":4: entrypoint[0] 'vllm serve' holds whitespace", '(e.g. ["vllm", "serve"])']],
    ),
    "entrypoint-empty-item": (
        [(IMAGE, IMAGE + '\nentrypoint = [""]')],
        [[":4: entrypoint[0] is empty: remove it"]],
    ),
    "mount-paths-with-a-colon": (
        [('host = "~/.cache/vllm"', 'host = "/data:/etc"'), ('mount = "/model"', 'mount = "/m:x"')],
        [
            [":18: composed_model.mount '/m:x' holds a ':'", "path without ':'"],
            [":25: extra_mounts[0].host '/data:/etc' holds a ':', which docker's -v reads"],
        ],
    ),
    "mounts-at-one-place": (
        [('container = "/root/.cache/vllm"', 'container = "/model/"')],
        [
            [
                ":26: extra_mounts[0].container '/model/' is where composed_model.mount (",
                "recipe.toml:18) mounts too: give each mount its own place in the container",
            ]
        ],
    ),
    "local-file-host-dotdot": (
        [("/var/tmp/engram-local/x.safetensors", "/var/tmp/../../etc/x.safetensors")],
        [
            [
                ":22: composed_model.local_files[0].host '/var/tmp/../../etc/x.safetensors' holds "
                "a '..' component: write the path it means without '..'"
            ]
        ],
    ),
    "parallel-size-too-big": (
        [("tensor_parallel_size = 2", "tensor_parallel_size = 100000000")],
        [
            [
                ":6: tensor_parallel_size: 100000000 is more than 1024, beyond any cluster",
                "write the number of nodes or GPUs meant",
            ]
        ],
    ),
    "readiness-timeout-fraction": (
        [(ENV, ENV + 'VLLM_ENGINE_READY_TIMEOUT_S = "60.5"\n')],
        [[":16: env.VLLM_ENGINE_READY_TIMEOUT_S '60.5' must be a positive number", "int()"]],
    ),
    "readiness-timeout-inf": (
        [(ENV, ENV + 'VLLM_ENGINE_READY_TIMEOUT_S = "inf"\n')],
        [[":16: env.VLLM_ENGINE_READY_TIMEOUT_S 'inf' must be a positive number"]],
    ),
}


@pytest.mark.parametrize("name", sorted(EDITED_RECIPES))
def test_edited_recipe_message(tmp_path: Path, name: str) -> None:
    edits, problems = EDITED_RECIPES[name]
    path = tmp_path / "recipe.toml"
    path.write_text(edited(GOOD_RECIPE, edits))
    expect_problems(load_recipe, path, RecipeError, problems)


def test_a_pin_below_env_is_not_an_env_variable(tmp_path: Path) -> None:
    path = tmp_path / "recipe.toml"
    path.write_text(GOOD_RECIPE.replace(ENV, ENV + 'model_revision = "abc"\n'))
    with pytest.raises(RecipeError) as caught:
        load_recipe(path)
    assert "must be a string" not in str(caught.value)


def test_image_references_docker_takes_load(tmp_path: Path) -> None:
    path = tmp_path / "recipe.toml"
    for image in (
        "ubuntu",
        "registry.local:5000/org/vllm_x__y:v1.2-rc",
        f"lab/x@sha256:{'a' * 64}",
    ):
        path.write_text(GOOD_RECIPE.replace(IMAGE, f'docker_image = "{image}"'))
        assert load_recipe(path).docker_image == image


@pytest.mark.parametrize(
    "revision", ["main", "refs/pr/1", "0" * 40, "", "a//b", "./x", "a/..", "/etc"]
)
def test_a_revision_is_refused_as_the_prefetch_refuses_it(tmp_path: Path, revision: str) -> None:
    path = tmp_path / "recipe.toml"
    path.write_text(GOOD_RECIPE.replace(IMAGE, f'{IMAGE}\nmodel_revision = "{revision}"'))
    try:
        load_recipe(path)
    except RecipeError as exc:
        refused: str | None = str(exc)
    else:
        refused = None
    assert (refused is None) == (relative_path_problem(revision) is None), refused


def test_a_from_file_symlink_out_of_the_recipe_dir_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    recipe_dir = tmp_path / "recipe"
    recipe_dir.mkdir()
    (recipe_dir / "config.json").symlink_to(outside)
    path = recipe_dir / "recipe.toml"
    local = 'host = "/var/tmp/engram-local/x.safetensors"'
    path.write_text(
        GOOD_RECIPE.replace(local, 'host = "/var/tmp/local/config.json"\nfrom_file = "config.json"')
    )
    expect_problems(
        load_recipe,
        path,
        RecipeError,
        [
            [
                ":23: composed_model.local_files[0].from_file:",
                f"config.json leads to {outside}, outside the recipe's dir (a symlink)",
            ]
        ],
    )
