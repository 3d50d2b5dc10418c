"""A local file's kind (Engram shard or plain file), decided by the recipe or the NAS and
explained; the recipe keys from_file and kind checked at load."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from lab.testing.hfcache_layout import cache_repo
from lab.tinymodel import EngramSpec, generate_repo
from sparkdeploy.cli import app
from sparkdeploy.errors import RecipeError
from sparkdeploy.spec.cluster import Cluster, load_cluster
from sparkdeploy.spec.plan import make_plan
from sparkdeploy.spec.recipe import Recipe
from sparkdeploy.spec.recipe_loading import load_recipe

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "clusters" / "dgx-spark-4.toml"
REPO = "lab-org/TinyKinds"
SPEC = EngramSpec.for_table_bytes(64 * 1024, n_heads=3)


def recipe_with(tmp_path: Path, local_files: str, model: str = REPO) -> Recipe:
    path = tmp_path / "recipes" / "kinds" / "recipe.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f'name = "kinds"\ndocker_image = "img"\nmodel = "{model}"\nrequired_nodes = 3\n'
        f'tensor_parallel_size = 3\n\n[composed_model]\nmount = "/model"\n{local_files}'
    )
    return load_recipe(path)


def local(host: str, extra: str = "") -> str:
    return f'\n[[composed_model.local_files]]\nhost = "{host}"\n{extra}'


def with_nas(cluster: Cluster, hf_cache: Path) -> Cluster:
    return cluster.model_copy(
        update={"nas": cluster.nas.model_copy(update={"hf_cache": str(hf_cache)})}
    )


def test_kinds_from_the_nas_headers_with_the_rule_that_decided(tmp_path: Path) -> None:
    generated = generate_repo(tmp_path / "repos", REPO, engram=SPEC, tp_size=3)
    cache_repo(generated, tmp_path / "hf-cache")
    engram_shard = generated.engram_shards[1]
    dense_shard = next(
        name
        for name in generated.files
        if name.endswith(".safetensors") and name not in generated.engram_shards.values()
    )
    recipe = recipe_with(
        tmp_path,
        local(f"/var/tmp/local/{engram_shard}")
        + local(f"/var/tmp/local/{dense_shard}")
        + local("/var/tmp/local/config.json")
        + local(f"/var/tmp/local/forced-{dense_shard}", 'kind = "plain"'),
    )
    plan = make_plan(recipe, with_nas(load_cluster(EXAMPLE), tmp_path / "hf-cache"))
    assert [(d.kind, d.why) for d in plan.local_files] == [
        ("engram", "holds the Engram tables of layers 1"),
        ("plain", "a safetensors file without Engram tables"),
        ("plain", "not a safetensors file"),
        ("plain", 'set in the recipe (kind = "plain")'),
    ]
    node = plan.nodes[0]
    assert [stage.dest for stage in node.engram] == [f"/var/tmp/local/{engram_shard}"]
    assert [stage.filename for stage in node.plain] == [
        dense_shard,
        "config.json",
        f"forced-{dense_shard}",
    ]
    assert all(stage.repo is not None and stage.repo.repo == REPO for stage in node.plain)
    assert node.composed is not None
    assert len(node.composed.local_files) == 4


def test_without_the_nas_the_name_and_config_decide(tmp_path: Path) -> None:
    recipe = recipe_with(
        tmp_path,
        local("/var/tmp/local/model-00047-of-00048.safetensors") + local("/var/tmp/local/x.json"),
    )
    plan = make_plan(recipe, with_nas(load_cluster(EXAMPLE), tmp_path / "no-nas"))
    (shard, config) = plan.local_files
    assert shard.kind == "engram"
    assert "assumed an Engram shard" in shard.why
    assert 'set kind = "plain"' in shard.why
    assert (config.kind, config.why) == ("plain", "not a safetensors file")
    # A config.json without engram_* keys: the model has no Engram tables at all.
    generated = generate_repo(tmp_path / "repos", REPO)
    cache_repo(generated, tmp_path / "hf-cache")
    plan = make_plan(recipe, with_nas(load_cluster(EXAMPLE), tmp_path / "hf-cache"))
    assert plan.local_files[0].kind == "plain"
    assert "config.json has no engram_* keys" in plan.local_files[0].why


def test_a_file_from_the_ops_host_is_plain_with_its_sha256_in_the_spec(tmp_path: Path) -> None:
    patch = tmp_path / "recipes" / "kinds" / "patches" / "generation_config.json"
    patch.parent.mkdir(parents=True)
    patch.write_text('{"temperature": 0.6}\n')
    recipe = recipe_with(
        tmp_path,
        local(
            "/var/tmp/local/generation_config.json", 'from_file = "patches/generation_config.json"'
        ),
    )
    cluster = load_cluster(EXAMPLE)
    plan = make_plan(recipe, cluster)
    assert plan.local_files[0].why == "from the ops host (patches/generation_config.json)"
    [stage] = plan.nodes[0].plain
    assert stage.repo is None
    assert stage.ops_file == str(patch.resolve())
    assert stage.size == len('{"temperature": 0.6}\n')
    label = plan.nodes[0].container.labels["sparkdeploy.spec"]
    patch.write_text('{"temperature": 0.7}\n')
    assert make_plan(recipe, cluster).nodes[0].container.labels["sparkdeploy.spec"] != label


def test_from_file_must_exist_under_the_recipe_dir(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as raised:
        recipe_with(
            tmp_path,
            local("/var/tmp/local/tokenizer.json", 'from_file = "patches/tokenizer.json"')
            + local("/var/tmp/local/chat.jinja", 'from_file = "../outside/chat.jinja"'),
        )
    lines = str(raised.value).splitlines()
    assert len(lines) == 2
    assert "composed_model.local_files[0].from_file" in lines[0]
    assert "patches/tokenizer.json does not exist" in lines[0]
    assert "put the file for tokenizer.json there" in lines[0]
    assert "composed_model.local_files[1].from_file '../outside/chat.jinja'" in lines[1]
    assert "without '..'" in lines[1]


def test_kind_engram_needs_a_safetensors_name_from_the_nas(tmp_path: Path) -> None:
    (tmp_path / "recipes" / "kinds").mkdir(parents=True)
    (tmp_path / "recipes" / "kinds" / "x.safetensors").write_bytes(b"")
    with pytest.raises(RecipeError) as raised:
        recipe_with(
            tmp_path,
            local("/var/tmp/local/config.json", 'kind = "engram"')
            + local("/var/tmp/local/x.safetensors", 'kind = "engram"\nfrom_file = "x.safetensors"'),
        )
    lines = str(raised.value).splitlines()
    assert 'local_files[0].kind = "engram" but config.json is not a .safetensors file' in lines[0]
    assert "remove from_file" in lines[1]


def test_plan_says_which_rule_decided_each_kind(tmp_path: Path) -> None:
    (tmp_path / "clusters").mkdir()
    (tmp_path / "clusters" / "dgx-spark-4.toml").write_text(EXAMPLE.read_text())
    recipe_with(
        tmp_path,
        local("/var/tmp/local/config.json")
        + local("/var/tmp/local/model-00047-of-00048.safetensors"),
        model="lab/tiny",
    )
    result = CliRunner().invoke(
        app, ["plan", "kinds", "--cluster", "dgx-spark-4", "--root", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert "# local file config.json: plain (not a safetensors file)" in result.stdout
    assert "# local file model-00047-of-00048.safetensors: engram (a safetensors" in result.stdout
    assert "# plain file config.json from lab/tiny in the NAS -> /var/tmp/local/config.json" in (
        result.stdout
    )
