import json
import shlex
import shutil
from pathlib import Path

from typer.testing import CliRunner, Result

from sparkdeploy.cli import app
from sparkdeploy.spec.plan import Plan

ROOT = Path(__file__).parent.parent
BAD = Path(__file__).parent / "fixtures" / "bad"
runner = CliRunner()


def test_validate_all_recipes_and_inventories_of_the_project() -> None:
    result = runner.invoke(app, ["validate", "--root", str(ROOT), "--no-check-files"])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""


def test_validate_prints_one_line_per_problem_and_fails() -> None:
    paths = [
        BAD / "recipes" / "bad-json.toml",
        BAD / "clusters" / "no-identity.toml",  # two problems
        ROOT / "recipes" / "dsv41-flash-eugr-0913-4x",  # a recipe dir: fine
    ]
    result = runner.invoke(app, ["validate", *map(str, paths)])
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith(f"{paths[0]}:10: --speculative-config: invalid JSON")
    assert lines[1].startswith(f"{paths[1]}:9: node node1 has no identity_file")
    assert lines[2].startswith(f"{paths[1]}:14: node node2 has no identity_file")
    assert "checked 3 files: 3 problems" in result.stderr


def test_validate_checks_identity_files_unless_told_not_to(tmp_path: Path) -> None:
    inventory = BAD / "clusters" / "missing-identity-file.toml"
    checked = runner.invoke(app, ["validate", str(inventory)])
    assert checked.exit_code == 1
    assert "keys/absent_ed25519 (nodes node1, node2) does not exist" in checked.stdout
    assert runner.invoke(app, ["validate", "--no-check-files", str(inventory)]).exit_code == 0


def test_validate_refuses_a_docker_image_dir_not_under_images(tmp_path: Path) -> None:
    recipe = tmp_path / "recipes" / "hand-built" / "recipe.toml"
    recipe.parent.mkdir(parents=True)
    recipe.write_text(
        (ROOT / "recipes" / "lab-single" / "recipe.toml")
        .read_text()
        .replace(
            'docker_image = "lab/vllm-standin:latest"\n',
            'docker_image = "glm:local"\ndocker_image_dir = "glm-r27"\n',
        )
    )
    line = recipe.read_text().splitlines().index('docker_image_dir = "glm-r27"') + 1
    refused = runner.invoke(app, ["validate", "--root", str(tmp_path)])
    assert refused.exit_code == 1
    [problem] = refused.stdout.splitlines()
    assert problem.startswith(f"{recipe}:{line}: docker_image_dir 'glm-r27': ")
    assert f"{tmp_path}/images/glm-r27/Dockerfile does not exist" in problem
    assert "add the image's build context (with its Dockerfile) at images/glm-r27/" in problem
    assert "remove docker_image_dir to use glm:local as the nodes hold it" in problem
    (tmp_path / "images" / "glm-r27").mkdir(parents=True)
    (tmp_path / "images" / "glm-r27" / "Dockerfile").write_text("FROM scratch\n")
    assert runner.invoke(app, ["validate", "--root", str(tmp_path)]).exit_code == 0


def test_validate_names_a_missing_or_directory_path_with_what_is_there(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "recipes" / "lab-single", tmp_path / "recipes" / "lab-single")
    (tmp_path / "clusters" / "dir.toml").mkdir(parents=True)
    shutil.copy(ROOT / "clusters" / "dgx-spark-4.toml", tmp_path / "clusters")
    paths = [
        tmp_path / "clusters" / "dir.toml",
        tmp_path / "recipes" / "nope",
        tmp_path / "clusters" / "nope.toml",
    ]
    result = runner.invoke(app, ["validate", "--root", str(tmp_path), *map(str, paths)])
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        f"{paths[0]}: is a directory, not a TOML file: name the file (a recipe is "
        "recipes/<name>/recipe.toml, an inventory clusters/<name>.toml)",
        f"{paths[1]}: does not exist (recipes under {tmp_path / 'recipes'}: lab-single); name a "
        "recipe dir or file, or an inventory clusters/<name>.toml",
        f"{paths[2]}: does not exist (inventories in {tmp_path / 'clusters'}: dgx-spark-4)",
    ]


def test_validate_with_nothing_to_check_fails(tmp_path: Path) -> None:
    result = runner.invoke(app, ["validate", "--root", str(tmp_path)])
    assert result.exit_code == 1
    assert "checked 0 files" in result.stderr


def test_plan_prints_a_readable_docker_run_per_node() -> None:
    result = runner.invoke(
        app, ["plan", "dsv41-flash-eugr-0913-4x", "--cluster", "dgx-spark-4", "--root", str(ROOT)]
    )
    assert result.exit_code == 0, result.output
    commands = [block for block in result.stdout.split("\n\n") if "docker run" in block]
    assert len(commands) == 4
    assert "# image eugr/spark-vllm-b12x:nightly-20260913: pulled on the nodes that lack it" in (
        result.stdout
    )
    for rank, block in enumerate(commands):
        assert f"# node dgx{rank + 1}: rank {rank}" in block
        argv = shlex.split(block[block.index("docker run") :].replace("\\\n", " "))
        spec = json.loads(argv[argv.index("--speculative-config") + 1])
        assert spec["method"] == "dspark"
        assert argv[argv.index("--node-rank") + 1] == str(rank)
        assert f"VLLM_HOST_IP=192.168.100.1{rank + 1}" in argv
        assert '    --engram-config \'{"cpu_offload":false,"table_memory":"disk"}\' \\' in block


def test_plan_json_and_node_choice_by_path() -> None:
    result = runner.invoke(
        app,
        [
            "plan",
            str(ROOT / "recipes" / "glm53-flash-r27-dflash2" / "recipe.toml"),
            "--cluster",
            str(ROOT / "clusters" / "dgx-spark-4.toml"),
            "--nodes",
            "dgx4,dgx2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    plan = Plan.model_validate_json(result.stdout)
    assert [node.node for node in plan.nodes] == ["dgx4", "dgx2"]
    assert plan.blocked is not None


def plan_of_one_recipe(project: Path, name: str, recipe_toml: str) -> Result:
    """`plan NAME --cluster dgx-spark-4` in a project of this repo's clusters and that recipe."""
    shutil.copytree(ROOT / "clusters", project / "clusters")
    recipe_dir = project / "recipes" / name
    recipe_dir.mkdir(parents=True)
    (recipe_dir / "recipe.toml").write_text(recipe_toml)
    return runner.invoke(app, ["plan", name, "--cluster", "dgx-spark-4", "--root", str(project)])


def test_plan_shows_the_blocked_reason(tmp_path: Path) -> None:
    result = plan_of_one_recipe(
        tmp_path,
        "tiny",
        'name = "tiny [BLOCKED]"\ndocker_image = "img"\nmodel = "lab/tiny"\nrequired_nodes = 2\n'
        'tensor_parallel_size = 2\ndocker_image_dir = "not-here"\n',
    )
    assert result.exit_code == 0, result.output
    assert (
        "# BLOCKED (a deploy refuses to start): the recipe's name says [BLOCKED]" in result.stdout
    )
    assert "# WARNING: images/not-here is not here, so img cannot be built" in result.stdout
    assert "    --distributed-executor-backend mp" in result.stdout
    assert "docker exec" not in result.stdout


def test_plan_refuses_a_ray_recipe_with_how_to_write_it_for_mp(tmp_path: Path) -> None:
    result = plan_of_one_recipe(
        tmp_path,
        "tiny-ray",
        'name = "tiny"\ndocker_image = "img"\nmodel = "lab/tiny"\nrequired_nodes = 2\n'
        'tensor_parallel_size = 2\ndistributed_backend = "ray"\n',
    )
    assert result.exit_code != 0
    assert 'recipe.toml:6: distributed_backend: "ray" is refused' in result.output
    assert "mp is the supported backend" in result.output


def test_plan_errors_name_what_to_fix() -> None:
    unknown = runner.invoke(app, ["plan", "dsv4", "--cluster", "dgx-spark-4", "--root", str(ROOT)])
    assert unknown.exit_code != 0
    assert "no recipe named 'dsv4'" in unknown.output
    assert "dsv41-flash-eugr-0913-4x" in unknown.output
    too_few = runner.invoke(
        app,
        [
            "plan",
            "dsv41-flash-eugr-0913-4x",
            "--cluster",
            "dgx-spark-4",
            "--nodes",
            "dgx1,dgx2",
            "--root",
            str(ROOT),
        ],
    )
    assert too_few.exit_code == 1
    assert "2 nodes selected (dgx1, dgx2) but the recipe needs required_nodes = 4" in too_few.stderr
    empty_name = runner.invoke(
        app,
        ["plan", "lab-single", "--cluster", "dgx-spark-4", "--nodes", ",", "--root", str(ROOT)],
    )
    assert empty_name.exit_code == 1
    assert "--nodes ',' has an empty node name: name each node, comma-separated" in (
        empty_name.stderr
    )
