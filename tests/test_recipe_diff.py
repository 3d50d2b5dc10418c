"""`sparkdeploy diff`: two recipes compared as the engine will see them."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from sparkdeploy.cli import app
from sparkdeploy.report.recipe_diff import diff_recipes, engine_flags
from sparkdeploy.spec.recipe_loading import load_recipe

ROOT = Path(__file__).parent.parent
runner = CliRunner()

BASE = """
name = "x"
docker_image = "img:1"
model = "org/model"
required_nodes = 1
args = [{args}]
[env]
HF_HUB_OFFLINE = "1"
{env}
"""


def recipe(tmp_path: Path, name: str, args: str, env: str = "") -> Path:
    path = tmp_path / name / "recipe.toml"
    path.parent.mkdir()
    path.write_text(BASE.format(args=args, env=env))
    return path


def test_spellings_vllm_reads_alike_are_no_difference(tmp_path: Path) -> None:
    a = recipe(
        tmp_path,
        "a",
        '"--max_num_seqs", "8", "--compilation-config", """\'{"level": 3}\'""", "--enforce-eager"',
    )
    b = recipe(
        tmp_path,
        "b",
        '"--enforce-eager", "--max-num-seqs=8", "--compilation-config", \'{ "level" : 3 }\'',
    )
    assert diff_recipes(load_recipe(a), load_recipe(b)).same
    result = runner.invoke(app, ["diff", str(a), str(b)])
    assert result.exit_code == 0
    assert result.stdout.splitlines()[-1] == "no difference the engine would see"


def test_flags_env_image_and_mounts_that_differ_are_listed(tmp_path: Path) -> None:
    a = recipe(tmp_path, "a", '"--max-num-seqs", "8", "--enforce-eager"', 'HF_TOKEN = "hf_aaa"')
    b = recipe(tmp_path, "b", '"--max-num-seqs", "4", "--no-enforce-eager"', 'HF_TOKEN = "hf_b"')
    b.write_text(
        b.read_text().replace('"img:1"', '"img:2"')
        + '\n[[extra_mounts]]\nhost = "/data"\ncontainer = "/data"\nread_only = true\n'
    )
    result = runner.invoke(app, ["diff", str(a), str(b)])
    assert result.exit_code == 1
    assert result.stdout.splitlines()[2:] == [
        "image:",
        "  docker_image: img:1 -> img:2",
        "args:",
        "  --max-num-seqs: 8 -> 4",
        "  --enforce-eager: true -> false",
        "env:",
        "  HF_TOKEN: *** -> *** (differs)",
        "mounts:",
        "  /data: (not set) -> /data (ro)",
    ]
    assert "hf_aaa" not in result.stdout
    assert "hf_b" not in result.stdout


def test_the_plans_flags_count_as_the_engine_gets_them() -> None:
    result = runner.invoke(app, ["diff", "real-lab-1x", "real-lab-2x", "--root", str(ROOT)])
    assert result.exit_code == 1
    assert "  --tensor-parallel-size: 1 -> 2" in result.stdout
    assert "  required_nodes: 1 -> 2" in result.stdout
    assert engine_flags(["m", "--x=1", "--y", "--no-z", "--w", "-1"]) == {
        "--x": "1",
        "--y": "true",
        "--z": "false",
        "--w": "-1",
    }


def test_a_recipe_that_cannot_be_read_exits_2() -> None:
    result = runner.invoke(app, ["diff", "real-lab-1x", "no-such-recipe", "--root", str(ROOT)])
    assert result.exit_code == 2
    assert "no recipe named 'no-such-recipe'" in result.stderr
