"""Secrets of a recipe: which values are secret, how the plan shows them (***), and the boot's
env-file path that keeps them out of every argv a node's `ps` shows."""

from __future__ import annotations

import pickle
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
from pydantic import SecretStr
from typer.testing import CliRunner

from lab.testing.local_node import LocalNode
from sparkdeploy.cli import app
from sparkdeploy.errors import ContainerStartError, RecipeError
from sparkdeploy.report.recipe_diff import diff_recipes
from sparkdeploy.secrecy import is_secret_flag, is_secret_name, redact
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import Plan, make_plan
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.steps import boot
from sparkdeploy.vllm.args import argv_has_flag

ROOT = Path(__file__).parent.parent
SINGLE = ROOT / "recipes" / "lab-single" / "recipe.toml"
EXAMPLE = ROOT / "clusters" / "dgx-spark-4.toml"
KEY, TOKEN, MINE = "k3y-value", "t0ken-value", "m1ne-value"
HF, OTHER_HF = "hf-t0ken-value", "hf-0ther-value"
NUMBER = 987654321  # a secret of the wrong type: never quoted either


def write_recipe(
    tmp_path: Path,
    *,
    args: Sequence[str] = (),
    env: str = "",
    top: str = "",
    raw_args: str = "",
    name: str = "lab-secret",
) -> Path:
    """lab-single with `args` (quoted) and `raw_args` (TOML as written) first in its args."""
    text = SINGLE.read_text()
    quoted = "".join(f'    "{a}",\n' for a in args)
    text = text.replace("args = [\n", "args = [\n" + quoted + raw_args)
    text = text.replace("[env]\n", f"[env]\n{env}")
    path = tmp_path / name / "recipe.toml"
    path.parent.mkdir()
    path.write_text(top + text)
    return path


@pytest.fixture
def secret_plan(tmp_path: Path) -> Plan:
    path = write_recipe(
        tmp_path,
        args=["--api-key", KEY],
        env=f'SENTINEL_TOKEN = "{TOKEN}"\nMY_VAR = "{MINE}"\nPLAIN = "visible"\n',
        top='secret_env = ["MY_VAR"]\n',
    )
    return make_plan(load_recipe(path), load_cluster(EXAMPLE))


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("VLLM_API_KEY", True),
        ("HF_TOKEN", True),
        ("db_password", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("OPENAI_APIKEY", True),
        ("hub.token", True),
        ("MY_VAR", False),
        ("OMP_NUM_THREADS", False),
        ("TOKENIZERS_PARALLELISM", False),
        ("VLLM_MAX_TOKENS", False),
        ("KEYBOARD", False),
    ],
)
def test_secret_names(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret
    assert is_secret_name(name, ["MY_VAR"]) is (secret or name == "MY_VAR")


def test_redact_masks_every_value() -> None:
    text = f"docker said {KEY} and {TOKEN}"
    assert redact(text, [SecretStr(KEY), None, SecretStr(""), SecretStr(TOKEN)]) == (
        "docker said *** and ***"
    )


def test_the_plan_carries_secrets_wrapped_and_shows_them_as_stars(secret_plan: Plan) -> None:
    [node] = secret_plan.nodes
    spec = node.container
    assert set(spec.secret_env) == {"SENTINEL_TOKEN", "MY_VAR", "VLLM_API_KEY"}
    assert spec.env["PLAIN"] == "visible"
    assert not set(spec.env) & set(spec.secret_env)
    # --api-key became VLLM_API_KEY: a flag would show in `ps` inside the node
    assert "--api-key" not in spec.command
    assert spec.env_file() == (
        f"SENTINEL_TOKEN={TOKEN}\nMY_VAR={MINE}\nVLLM_API_KEY={KEY}\n".encode()
    )
    assert secret_plan.api_key is not None
    assert secret_plan.api_key.get_secret_value() == KEY
    shown = [
        " ".join(spec.docker_run_argv()),
        repr(secret_plan),
        str(secret_plan.model_dump()),
        secret_plan.model_dump_json(),
    ]
    for text in shown:
        assert not {KEY, TOKEN, MINE} & set(re.split(r"[\s'\"=,]", text)), text
    assert '"api_key":"***"' in secret_plan.model_dump_json()
    # Prefect pickles plans between tasks: the values survive the trip.
    assert pickle.loads(pickle.dumps(secret_plan)) == secret_plan


def test_sparkdeploy_plan_prints_stars(tmp_path: Path) -> None:
    path = write_recipe(tmp_path, args=["--api-key", KEY], env=f'HF_TOKEN = "{TOKEN}"\n')
    runner = CliRunner()
    for options in ([], ["--json"]):
        result = runner.invoke(app, ["plan", str(path), "--cluster", str(EXAMPLE), *options])
        assert result.exit_code == 0, result.output
        assert KEY not in result.output
        assert TOKEN not in result.output
        assert "***" in result.output
    text = runner.invoke(app, ["plan", str(path), "--cluster", str(EXAMPLE)]).output
    assert "--env-file <0600 file: HF_TOKEN=*** VLLM_API_KEY=***>" in text


@pytest.mark.parametrize(
    ("flag", "secret"),
    [
        ("--api-key", True),
        ("--api_key", True),
        ("--hf-token", True),
        ("--vault-token", True),  # in vLLM's own SENSITIVE_ARGS
        ("--db-password", True),
        ("--client-secret", True),
        ("--max-num-batched-tokens", False),
        ("--return-tokens-as-token-ids", False),
        ("--ssl-keyfile", False),
        ("--tokenizer", False),
    ],
)
def test_secret_flags(flag: str, secret: bool) -> None:
    assert is_secret_flag(flag) is secret


def test_hf_token_flag_reaches_vllm_as_secret_env_and_shows_nowhere(tmp_path: Path) -> None:
    path = write_recipe(tmp_path, args=["--hf-token", HF])
    plan = make_plan(load_recipe(path), load_cluster(EXAMPLE))
    [node] = plan.nodes
    spec = node.container
    # vLLM reads HF_TOKEN when --hf-token is absent; the flag would show in `ps` and vLLM's log
    assert not argv_has_flag(spec.command, "--hf-token")
    assert HF not in " ".join(spec.docker_run_argv())
    assert spec.env_file() == f"HF_TOKEN={HF}\n".encode()
    assert HF not in plan.model_dump_json()
    assert HF not in repr(plan)
    runner = CliRunner()
    for options in ([], ["--json"]):
        result = runner.invoke(app, ["plan", str(path), "--cluster", str(EXAMPLE), *options])
        assert result.exit_code == 0, result.output
        assert HF not in result.output
        assert "***" in result.output
    recording = node_with_docker_stub(tmp_path)
    boot._run(recording, node, {})
    [argv] = [ran.argv for ran in recording.ran]
    assert all(HF not in arg for arg in argv)
    assert "--env-file" in argv[2]


def test_a_bare_hf_token_flag_stays_a_flag(tmp_path: Path) -> None:
    """`--hf-token` alone is vLLM's "use the stored login": no value, no secret."""
    path = write_recipe(tmp_path, args=["--hf-token", "--enforce-eager"])
    [node] = make_plan(load_recipe(path), load_cluster(EXAMPLE)).nodes
    assert argv_has_flag(node.container.command, "--hf-token")
    assert "HF_TOKEN" not in node.container.secret_env


def test_recipe_diff_masks_secret_flags(tmp_path: Path) -> None:
    a = load_recipe(write_recipe(tmp_path, args=["--hf-token", HF], name="a"))
    b = load_recipe(write_recipe(tmp_path, args=[f"--hf-token={OTHER_HF}"], name="b"))
    found = diff_recipes(a, b)
    text = found.text() + found.markdown()
    assert HF not in text
    assert OTHER_HF not in text
    assert "HF_TOKEN: *** -> *** (differs)" in found.text()


@pytest.mark.parametrize(
    ("raw_args", "env", "top", "problem"),
    [
        (f'    "--api-key", {NUMBER},\n', "", "", "args[1]: must be a string"),
        (f'    "--hf-token", {NUMBER},\n', "", "", "args[1]: must be a string"),
        (f'    "--hf-token", ["{HF}"],\n', "", "", "args[1]: must be a string"),
        ("", f"MY_VAR = {NUMBER}\n", 'secret_env = ["MY_VAR"]\n', "env.MY_VAR: must be"),
        ("", f'MY_VAR = ["{HF}"]\n', 'secret_env = ["MY_VAR"]\n', "env.MY_VAR: must be"),
        (f'    "--hf-token", "{HF}",\n', f'HF_TOKEN = "{HF}"\n', "", "both set the HF token"),
        (f'    "--vault-token", "{HF}",\n', "", "", "--vault-token takes a secret"),
        (f'    "--hf-token", "\'{HF}\'",\n', "", "", ""),  # quotes kept, never echoed
    ],
)
def test_secret_values_of_any_type_are_never_quoted(
    tmp_path: Path, raw_args: str, env: str, top: str, problem: str
) -> None:
    path = write_recipe(tmp_path, raw_args=raw_args, env=env, top=top)
    if not problem:
        plan = make_plan(load_recipe(path), load_cluster(EXAMPLE))
        assert plan.nodes[0].container.env_file() == f"HF_TOKEN='{HF}'\n".encode()
        return
    with pytest.raises(RecipeError) as refused:
        load_recipe(path)
    message = str(refused.value)
    assert problem in message
    assert str(NUMBER) not in message
    assert HF not in message


@pytest.mark.parametrize(
    ("args", "env", "top", "problem"),
    [
        (["--api-key"], "", "", "--api-key needs a value"),
        (["--api-key", KEY], f'VLLM_API_KEY = "{KEY}"\n', "", "both set the API key"),
        ([], "", 'secret_env = ["NOPE"]\n', "secret_env names 'NOPE', which [env] does not"),
        ([], 'MY_TOKEN = "a\\nb"\n', "", "env.MY_TOKEN (a secret) contains a line break"),
        ([], "MY_TOKEN = 12345\n", "", "must be a string"),
        (["--api-key", KEY, "second-key"], "", "", "stray value *** with no flag"),
    ],
)
def test_recipe_problems_never_echo_a_secret(
    tmp_path: Path, args: list[str], env: str, top: str, problem: str
) -> None:
    path = write_recipe(tmp_path, args=args, env=env, top=top)
    with pytest.raises(RecipeError) as refused:
        load_recipe(path)
    message = str(refused.value)
    assert problem in message
    assert KEY not in message
    assert "12345" not in message
    assert "second-key" not in message


def node_with_docker_stub(bin_dir: Path, exit_code: int = 0) -> LocalNode:
    """A node run on this machine (it keeps the commands it ran) whose `docker` is a stub that
    reports its argv and its env file (path, mode, content) and exits `exit_code`."""
    stub = bin_dir / "docker"
    stub.write_text(
        "#!/bin/sh\n"
        'echo "argv: $*" >&2\n'
        'if [ "$2" = --env-file ]; then stat -c "mode %a" "$3" >&2; cat "$3" >&2;'
        ' echo "$3" >"$0.envfile"; fi\n'
        f"[ {exit_code} = 0 ] && echo container-id\n"
        f"exit {exit_code}\n"
    )
    stub.chmod(0o755)
    return LocalNode(path=f"{bin_dir}:/usr/bin:/bin")


def test_boot_passes_secrets_in_a_0600_env_file_removed_after_the_run(
    secret_plan: Plan, tmp_path: Path
) -> None:
    runner = node_with_docker_stub(tmp_path)
    [node] = secret_plan.nodes
    assert boot._run(runner, node, {"NCCL_IB_HCA": "mlx5_0"}) == "container-id"
    [argv] = [ran.argv for ran in runner.ran]
    assert all(value not in arg for arg in argv for value in (KEY, TOKEN, MINE))
    assert "NCCL_IB_HCA=mlx5_0" in argv
    assert node.container.image in argv
    env_file = Path((tmp_path / "docker.envfile").read_text().strip())
    assert not env_file.exists()


def test_a_failed_run_removes_the_env_file_and_its_error_names_no_secret(
    secret_plan: Plan, tmp_path: Path
) -> None:
    runner = node_with_docker_stub(tmp_path, exit_code=125)
    with pytest.raises(ContainerStartError) as failed:
        boot._run(runner, secret_plan.nodes[0], {})
    message = str(failed.value)
    assert "exited 125" in message
    assert "mode 600" in message
    assert "SENTINEL_TOKEN=***" in message
    assert TOKEN not in message
    assert KEY not in message
    assert not Path((tmp_path / "docker.envfile").read_text().strip()).exists()


def test_a_recipe_without_secrets_runs_docker_directly(tmp_path: Path) -> None:
    plan = make_plan(load_recipe(SINGLE), load_cluster(EXAMPLE))
    runner = node_with_docker_stub(tmp_path)
    boot._run(runner, plan.nodes[0], {})
    [argv] = [ran.argv for ran in runner.ran]
    assert argv[:2] == ("docker", "run")
    assert "--env-file" not in argv
