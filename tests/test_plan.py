import json
import pickle
from pathlib import Path

import pytest

from sparkdeploy.errors import PlanError
from sparkdeploy.spec.cluster import Cluster, load_cluster
from sparkdeploy.spec.container import MASTER_PORT
from sparkdeploy.spec.plan import Plan, make_plan, spec_digest
from sparkdeploy.spec.recipe import Recipe
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.vllm.markers import DEFAULT_BOOT_MARKERS, DEFAULT_FAILURE_MARKERS

ROOT = Path(__file__).parent.parent
DSV41 = ROOT / "recipes" / "dsv41-flash-eugr-0913-4x" / "recipe.toml"
GLM53 = ROOT / "recipes" / "glm53-flash-r27-dflash2" / "recipe.toml"
EXAMPLE = ROOT / "clusters" / "dgx-spark-4.toml"
JSON_FLAGS = [
    "--compilation-config",
    "--speculative-config",
    "--engram-config",
    "--override-generation-config",
    "--limit-mm-per-prompt",
]


@pytest.fixture(scope="module")
def example() -> Cluster:
    return load_cluster(EXAMPLE)


@pytest.fixture(scope="module")
def dsv41_plan(example: Cluster) -> Plan:
    return make_plan(load_recipe(DSV41), example)


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_dsv41_json_flags_are_valid_json_without_stray_quotes(dsv41_plan: Plan) -> None:
    for node in dsv41_plan.nodes:
        argv = node.container.docker_run_argv()
        for flag in JSON_FLAGS:
            value = flag_value(argv, flag)
            assert value[0] in "{[", (node.node, flag, value)
            assert value[-1] in "}]", (node.node, flag, value)
            json.loads(value)
        assert json.loads(flag_value(argv, "--speculative-config"))["num_speculative_tokens"] == 7
        assert json.loads(flag_value(argv, "--limit-mm-per-prompt")) == {"image": 2}


def test_dsv41_rank_flags_per_node(dsv41_plan: Plan) -> None:
    assert [(n.node, n.rank, n.role, n.tp_ranks) for n in dsv41_plan.nodes] == [
        ("dgx1", 0, "head", [0]),
        ("dgx2", 1, "worker", [1]),
        ("dgx3", 2, "worker", [2]),
        ("dgx4", 3, "worker", [3]),
    ]
    for node in dsv41_plan.nodes:
        command = node.container.command
        assert command[0] == "deepseek-ai/DeepSeek-V4.1-Flash"
        assert flag_value(command, "--tensor-parallel-size") == "4"
        assert flag_value(command, "--nnodes") == "4"
        assert flag_value(command, "--node-rank") == str(node.rank)
        assert flag_value(command, "--master-addr") == "192.168.100.11"
        assert flag_value(command, "--master-port") == str(MASTER_PORT)
        assert ("--headless" in command) == (node.rank > 0)
        assert command.count("--distributed-executor-backend") == 1
        assert node.container.entrypoint == ["vllm", "serve"]


def test_dsv41_env_per_node(dsv41_plan: Plan) -> None:
    for index, node in enumerate(dsv41_plan.nodes):
        env = node.container.env
        assert env["VLLM_HOST_IP"] == f"192.168.100.1{index + 1}"
        for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "UCX_NET_DEVICES"):
            assert env[key] == "enp1s0f1np1"
        assert env["NCCL_IB_HCA"] == "rocep1s0f1,roceP2p1s0f1"
        assert env["HF_HUB_OFFLINE"] == "1"
        assert env["HF_HUB_CACHE"] == "/model"
        assert env["NCCL_IB_DISABLE"] == "0"  # the cluster's [nccl.ds4] profile
        assert env["VLLM_MXFP8_LM_HEAD"] == "0"  # the recipe's own env
    gid = [node.container.env.get("NCCL_IB_GID_INDEX") for node in dsv41_plan.nodes]
    assert gid == [None, None, None, "3"]  # "auto" is left to detection on the node


def test_dsv41_container_mounts_labels_and_data_steps(dsv41_plan: Plan) -> None:
    dep = dsv41_plan.deployment_id
    assert dep.startswith("dsv41-flash-eugr-0913-4x-")
    assert dsv41_plan.endpoint == "http://192.168.100.11:8000"
    assert dsv41_plan.served_model_name == "dsv41"
    assert [repo.repo for repo in dsv41_plan.repos] == ["deepseek-ai/DeepSeek-V4.1-Flash"]
    for node in dsv41_plan.nodes:
        spec = node.container
        composed_root = f"/var/tmp/sparkdeploy/composed/{dep}"
        assert [(m.source, m.target, m.read_only) for m in spec.mounts] == [
            (composed_root, "/model", True),
            ("/mnt/nas/hf-cache", "/mnt/nas/hf-cache", True),
        ]
        assert spec.labels == {
            "sparkdeploy.deployment": dep,
            "sparkdeploy.recipe": "dsv41-flash-eugr-0913-4x",
            "sparkdeploy.node": node.node,
            "sparkdeploy.rank": str(node.rank),
            "sparkdeploy.spec": spec_digest(node),
        }
        argv = spec.docker_run_argv()
        for option in (["--network", "host"], ["--ipc", "host"], ["--gpus", "all"]):
            assert " ".join(option) in " ".join(argv)
        ulimits_at = argv.index("--ulimit")
        assert argv[ulimits_at : ulimits_at + 4] == [
            "--ulimit",
            "memlock=-1",
            "--ulimit",
            "stack=67108864",
        ]
        assert "--device=/dev/infiniband" in argv
        assert argv[argv.index("eugr/spark-vllm-b12x:nightly-20260913") + 1] == "serve"
        assert node.composed is not None
        assert node.composed.root == composed_root
        assert [(s.filename, s.ranks, s.tp_size) for s in node.engram] == [
            ("model-00047-of-00048.safetensors", [node.rank], 4),
            ("model-00048-of-00048.safetensors", [node.rank], 4),
        ]
        assert node.engram[0].repo.repo == "deepseek-ai/DeepSeek-V4.1-Flash"
        assert node.engram[0].dest.startswith("/var/tmp/engram-local/DeepSeek-V4.1-Flash/")


def test_deployment_id_is_stable_and_depends_on_the_nodes(example: Cluster) -> None:
    recipe = load_recipe(GLM53)
    first = make_plan(recipe, example).deployment_id
    assert make_plan(load_recipe(GLM53), load_cluster(EXAMPLE)).deployment_id == first
    assert make_plan(recipe, example, ["dgx2", "dgx1"]).deployment_id != first


def test_plan_is_plain_data(dsv41_plan: Plan) -> None:
    assert Plan.model_validate_json(dsv41_plan.model_dump_json()) == dsv41_plan
    assert pickle.loads(pickle.dumps(dsv41_plan)) == dsv41_plan


def test_glm53_plan_mounts_markers_and_smoke(example: Cluster) -> None:
    plan = make_plan(load_recipe(GLM53), example, ["dgx3", "dgx4"])
    assert plan.blocked is not None
    assert plan.readiness_timeout_s == 3600.0
    assert plan.smoke.chat_template_kwargs == {"reasoning_effort": "low"}
    assert [repo.repo for repo in plan.repos][1] == "incoai/GLM-5.3-Flash-DFlash2"
    assert [m.name for m in plan.boot_markers] == [
        "weights loaded",
        "quantprobe: MTP quant algo detected",
        "KV cache sized",
        "API up",
    ]
    names = [m.name for m in plan.failure_markers]
    assert names[: len(DEFAULT_FAILURE_MARKERS)] == [m.name for m in DEFAULT_FAILURE_MARKERS]
    assert "quantprobe: MTP patch missed (algo=None)" in names
    head = plan.nodes[0]
    assert head.node == "dgx3"
    assert plan.endpoint == "http://192.168.100.13:8000"
    assert head.container.env["HF_HUB_CACHE"] == "/mnt/nas/hf-cache"
    assert head.composed is None
    assert head.engram == []
    assert [(m.source, m.target) for m in head.container.mounts][1] == (
        "/root/sm121-cache/glm53-jit-121f/b12x",
        "/root/.cache/b12x",
    )


def test_tilde_is_the_ssh_users_home_on_the_node(tmp_path: Path) -> None:
    inventory = tmp_path / "ops.toml"
    inventory.write_text(EXAMPLE.read_text().replace('user = "root"', 'user = "ops"'))
    plan = make_plan(load_recipe(GLM53), load_cluster(inventory))
    assert plan.nodes[1].container.mounts[1].source == "/home/ops/sm121-cache/glm53-jit-121f/b12x"


def small_recipe(tmp_path: Path, extra: str = "", **keys: str) -> Recipe:
    fields = {
        "name": '"tiny"',
        "docker_image": '"lab/vllm-standin:latest"',
        "model": '"lab/tiny"',
        "required_nodes": "2",
        "tensor_parallel_size": "2",
    } | keys
    path = tmp_path / "tiny" / "recipe.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text("".join(f"{k} = {v}\n" for k, v in fields.items()) + extra)
    return load_recipe(path)


def test_single_node_mp_has_no_multinode_flags_and_pins_the_revision(
    tmp_path: Path, example: Cluster
) -> None:
    sha = "0" * 40
    recipe = small_recipe(
        tmp_path, required_nodes="1", tensor_parallel_size="1", model_revision=f'"{sha}"'
    )
    (node,) = make_plan(recipe, example).nodes
    spec = node.container
    assert spec.command == [
        "lab/tiny",
        "--revision",
        sha,
        "--tensor-parallel-size",
        "1",
        "--pipeline-parallel-size",
        "1",
        "--distributed-executor-backend",
        "mp",
    ]
    argv = spec.docker_run_argv()
    assert "--entrypoint" not in argv  # the image's own entrypoint
    assert argv[-len(spec.command) - 1 :] == ["lab/vllm-standin:latest", *spec.command]


def test_default_markers_when_the_recipe_names_none(tmp_path: Path, example: Cluster) -> None:
    plan = make_plan(small_recipe(tmp_path), example)
    assert [m.name for m in plan.boot_markers] == [m.name for m in DEFAULT_BOOT_MARKERS]
    assert plan.api_port == 8000
    assert plan.served_model_name == "lab/tiny"


@pytest.mark.parametrize(
    ("keys", "fragments"),
    [
        ({"nccl_profile": '"ds-4"'}, ["nccl_profile 'ds-4' is not defined in", "'ds4'?"]),
        ({"nccl_profile": '"ib"'}, ["(profiles: ds4)", "add [nccl.ib] to"]),
        (
            {"required_nodes": "2", "tensor_parallel_size": "4"},
            ["needs 2 GPUs per node", "dgx1 (1), dgx2 (1)", "raise required_nodes"],
        ),
        ({"required_nodes": "5", "tensor_parallel_size": "5"}, ["needs 5 nodes", "has 4"]),
    ],
)
def test_placement_errors(
    tmp_path: Path, example: Cluster, keys: dict[str, str], fragments: list[str]
) -> None:
    with pytest.raises(PlanError) as caught:
        make_plan(small_recipe(tmp_path, **keys), example)
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_the_spec_label_changes_with_what_runs_not_with_how_the_node_is_reached(
    tmp_path: Path, example: Cluster
) -> None:
    def spec(recipe: Recipe, cluster: Cluster = example) -> str:
        return make_plan(recipe, cluster).nodes[0].container.labels["sparkdeploy.spec"]

    for name in "abcdefg":
        (tmp_path / name).mkdir()

    base = spec(small_recipe(tmp_path / "a"))
    assert spec(small_recipe(tmp_path / "b")) == base  # the same recipe elsewhere
    revised = small_recipe(tmp_path / "c", model_revision=f'"{"a" * 40}"')
    assert spec(revised) != base
    assert spec(small_recipe(tmp_path / "d", args='["--max-model-len", "8192"]')) != base
    moved = tmp_path / "moved.toml"
    moved.write_text(EXAMPLE.read_text().replace("port = 22", "port = 2222"))
    assert spec(small_recipe(tmp_path / "e"), load_cluster(moved)) == base
    # A secret's value never reaches the label (nor its digest): a new key is the smoke
    # test's 401 instead.
    keyed = [
        spec(small_recipe(tmp_path / name, args=f'["--api-key", "{key}"]'))
        for name, key in (("f", "sk-one"), ("g", "sk-two"))
    ]
    assert keyed[0] == keyed[1] != base


def test_the_smoke_checks_the_head_flags_enable_are_the_plans(
    tmp_path: Path, example: Cluster
) -> None:
    plain = make_plan(small_recipe(tmp_path), example)
    assert (plain.tool_calls_enabled, plain.reasoning_enabled) == (False, False)
    flags = (
        '["--enable_auto_tool_choice", "--tool-call-parser", "hermes", "--reasoning-parser=qwen3"]'
    )
    flagged = make_plan(small_recipe(tmp_path, args=flags), example)
    assert (flagged.tool_calls_enabled, flagged.reasoning_enabled) == (True, True)
    assert "lab/tiny" in flagged.head_serve_argv[:3]


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (
            '[[extra_mounts]]\nhost = "/data"\ncontainer = "/mnt/nas/hf-cache/"\n',
            ["the recipe's extra_mounts[0].container and", "nas.hf_cache", "move the recipe's"],
        ),
        (
            '[composed_model]\nmount = "/mnt/nas/hf-cache"\n',
            ["nas.hf_cache", "and the recipe's composed_model.mount both mount at"],
        ),
    ],
)
def test_a_recipe_mount_where_the_nas_cache_mounts_is_refused(
    tmp_path: Path, example: Cluster, extra: str, fragments: list[str]
) -> None:
    with pytest.raises(PlanError) as caught:
        make_plan(small_recipe(tmp_path, extra), example)
    for fragment in fragments:
        assert fragment in str(caught.value)
