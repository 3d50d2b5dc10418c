"""Bad recipes and inventories made from a good file with one or a few edits each.

Each case names the fragments its error must hold (the line, what is wrong, the fix); a case
with several problems checks that every one is reported, in file order, in one pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cluster import CONTRACT_INVENTORY

from sparkdeploy.errors import InventoryError, RecipeError, SparkDeployError
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.recipe_loading import load_recipe

GOOD_RECIPE = """\
engine = "vllm"
name = "Tiny test recipe"
docker_image = "lab/vllm-standin:latest"
model = "lab/tiny-model"
required_nodes = 2
tensor_parallel_size = 2
distributed_backend = "mp"
args = [
    "--max-model-len", "4096",
    "--served-model-name", "tiny",
    "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
]

[env]
OMP_NUM_THREADS = "2"

[composed_model]
mount = "/model"
[[composed_model.sources]]
repo = "lab/tiny-model"
[[composed_model.local_files]]
host = "/var/tmp/engram-local/x.safetensors"

[[extra_mounts]]
host = "~/.cache/vllm"
container = "/root/.cache/vllm"

[[failure_markers]]
name = "probe broken"
pattern = '\\[probe\\] algo=None'

[smoke]
max_tokens = 8
"""

Edit = tuple[str, str]  # (text found once in the good file, its replacement)

# What a Ray recipe is told: mp is the supported backend, why, and how to write the recipe.
RAY_REFUSAL = [
    "mp is the supported backend",
    "multi-node mp executor needs no Ray cluster",
    "the lab and CI run it on real vLLM",
    "the Ray path was never run",
    "current platform cpu does not support ray",
    'distributed_backend = "mp"',
    '"--distributed-executor-backend", "mp"',
    "drop any Ray-specific args and env",
]

# name: (edits, fragments; a list of fragments per problem when there are several)
RECIPE_CASES: dict[str, tuple[list[Edit], list[list[str]]]] = {
    "key-typo": (
        [("tensor_parallel_size", "tensor_paralel_size")],
        [[":6: unknown key 'tensor_paralel_size'", "did you mean 'tensor_parallel_size'?"]],
    ),
    "key-in-wrong-table": (
        [("[smoke]\n", '[smoke]\nmount = "/m"\n')],
        [[":33: unknown key 'smoke.mount'", "belongs in [composed_model]: move it there"]],
    ),
    "top-level-key-in-table": (
        [("max_tokens = 8", "model = 1")],
        [[":33: unknown key 'smoke.model'", "belongs in the top level"]],
    ),
    "unknown-section": (
        [("[smoke]", "[smok]")],
        [[":32: unknown key 'smok'", "did you mean 'smoke'?"]],
    ),
    "nested-typo": (
        [('repo = "lab/tiny-model"', 'repo = "lab/tiny-model"\nrevison = "abc"')],
        [[":21: unknown key 'composed_model.sources[0].revison'", "did you mean 'revision'"]],
    ),
    "string-for-int": (
        [("required_nodes = 2", 'required_nodes = "2"')],
        [[":5: required_nodes:", "valid integer", "write it without quotes"]],
    ),
    "int-for-string": (
        [('name = "Tiny test recipe"', "name = 7")],
        [[":2: name: must be a string: quote it (got 7)"]],
    ),
    "bool-as-string": (
        [
            (
                'container = "/root/.cache/vllm"\n',
                'container = "/root/.cache/vllm"\nread_only = "yes"\n',
            )
        ],
        [[":27: extra_mounts[0].read_only:", "valid boolean"]],
    ),
    "args-item-a-list": (
        [('"--served-model-name", "tiny",', '["--served-model-name", "tiny"],')],
        [[":10: args[2]: must be a string, not a list", "one quoted value"]],
    ),
    "args-item-not-string": (
        [('"--max-model-len", "4096"', '"--max-model-len", 4096')],
        [[":9: args[1]: must be a string: quote it (got 4096)"]],
    ),
    "empty-args-item": (
        [('"--served-model-name", "tiny",', '"--served-model-name", "tiny", "",')],
        [[":10: args[4] is empty: remove it"]],
    ),
    "flag-equals-and-spaced": (
        [('"--max-model-len", "4096",', '"--max-model-len", "4096", "--max_model_len=8192",')],
        [[":9: --max_model_len is given twice (first at", ":9)", "keep one"]],
    ),
    "stray-value": (
        [('"--served-model-name", "tiny",', '"--served-model-name", "tiny", "lab/other",')],
        [[":10: stray value 'lab/other'", "the model goes in `model`"]],
    ),
    "json-flag-not-json": (
        [('"num_speculative_tokens": 2}', '"num_speculative_tokens": 2,}')],
        [[":11: --speculative-config: invalid JSON", "fix the JSON"]],
    ),
    "json-flag-without-value": (
        [('\'{"method": "ngram", "num_speculative_tokens": 2}\',', "")],
        [[":11: --speculative-config needs a JSON value"]],
    ),
    "quoted-non-json": (
        [('"tiny",', "\"'tiny'\",")],
        [[":10: --served-model-name", "single quotes", "remove them"]],
    ),
    "plan-flag": (
        [('"--max-model-len", "4096",', '"--max-model-len", "4096", "-tp", "2",')],
        [[":9: -tp is set by the plan from tensor_parallel_size", "remove it from args"]],
    ),
    "port-not-number": (
        [('"tiny",', '"tiny", "--port", "http",')],
        [[":10: --port 'http' is not a number"]],
    ),
    "backend-mismatch": (
        [('"tiny",', '"tiny", "--distributed-executor-backend", "uni",')],
        [[":10: --distributed-executor-backend uni contradicts", '"mp"', "make them agree"]],
    ),
    "unknown-backend": (
        [('distributed_backend = "mp"', 'distributed_backend = "nccl"')],
        [[":7: distributed_backend:", "should be 'mp'", "'nccl'"]],
    ),
    # Ray is refused (issue 25): the key, the flag (either spelling), and both at once.
    "ray-backend": (
        [('distributed_backend = "mp"', 'distributed_backend = "ray"')],
        [[':7: distributed_backend: "ray" is refused', *RAY_REFUSAL]],
    ),
    "ray-executor-flag": (
        [('"tiny",', '"tiny", "--distributed-executor-backend", "ray",')],
        [[":10: --distributed-executor-backend ray is refused", *RAY_REFUSAL]],
    ),
    "ray-executor-flag-equals": (
        [('"tiny",', '"tiny", "--distributed-executor-backend=ray",')],
        [[":10: --distributed-executor-backend ray is refused", *RAY_REFUSAL]],
    ),
    "ray-backend-and-flag": (
        [
            ('distributed_backend = "mp"', 'distributed_backend = "ray"'),
            ('"tiny",', '"tiny", "--distributed-executor-backend", "ray",'),
        ],
        [
            [':7: distributed_backend: "ray" is refused', *RAY_REFUSAL],
            [":10: --distributed-executor-backend ray is refused", *RAY_REFUSAL],
        ],
    ),
    "unknown-engine": (
        [('engine = "vllm"', 'engine = "sglang"')],
        [[":1: engine:", "'vllm'", "'sglang'"]],
    ),
    "tp-not-dividing-nodes": (
        [("required_nodes = 2", "required_nodes = 3")],
        [[":5: required_nodes = 3 does not divide", "= 2", "same number of ranks"]],
    ),
    "zero-nodes": (
        [("required_nodes = 2", "required_nodes = 0")],
        [[":5: required_nodes:", "greater than or equal to 1"]],
    ),
    "missing-model": (
        [('model = "lab/tiny-model"\n', "")],
        [["recipe.toml: model: required key is missing: add it"]],
    ),
    "bad-repo-id": (
        [('model = "lab/tiny-model"', 'model = "tiny-model"')],
        [[":4: model:", "not a Hugging Face repo id", "'org/name'"]],
    ),
    "bad-shm-size": (
        [('engine = "vllm"', 'engine = "vllm"\nshm_size = "lots"')],
        [[":2: shm_size:", "not a size", '"32gb"']],
    ),
    "empty-entrypoint": (
        [('engine = "vllm"', 'engine = "vllm"\nentrypoint = []')],
        [[":2: entrypoint:", "empty entrypoint runs nothing"]],
    ),
    "env-not-string": (
        [('OMP_NUM_THREADS = "2"', "OMP_NUM_THREADS = 2")],
        [[":15: env.OMP_NUM_THREADS: must be a string: quote it"]],
    ),
    "env-per-node": (
        [('OMP_NUM_THREADS = "2"', 'NCCL_SOCKET_IFNAME = "eth0"')],
        [[":15: env.NCCL_SOCKET_IFNAME is set per node", "remove it"]],
    ),
    "env-hub-online": (
        [('OMP_NUM_THREADS = "2"', 'HF_HUB_OFFLINE = "0"')],
        [[':15: env.HF_HUB_OFFLINE must be "1"']],
    ),
    "env-bad-timeout": (
        [('OMP_NUM_THREADS = "2"', 'VLLM_ENGINE_READY_TIMEOUT_S = "-5"')],
        [[":15: env.VLLM_ENGINE_READY_TIMEOUT_S '-5' must be a positive number"]],
    ),
    "relative-composed-mount": (
        [('mount = "/model"', 'mount = "model"')],
        [[":18: composed_model.mount 'model' must be an absolute path in the container"]],
    ),
    "relative-local-file": (
        [('host = "/var/tmp/engram-local/x.safetensors"', 'host = "x.safetensors"')],
        [[":22: composed_model.local_files[0].host 'x.safetensors' must be an absolute path"]],
    ),
    "relative-mount-host": (
        [('host = "~/.cache/vllm"', 'host = "cache/vllm"')],
        [[":25: extra_mounts[0].host 'cache/vllm' must be absolute or start with ~/"]],
    ),
    "relative-mount-container": (
        [('container = "/root/.cache/vllm"', 'container = "cache"')],
        [[":26: extra_mounts[0].container 'cache' must be an absolute path"]],
    ),
    "regex-does-not-compile": (
        [("pattern = '\\[probe\\] algo=None'", "pattern = '[probe algo=None'")],
        [[":30: failure_markers[0].pattern", "not a valid regular expression", "backslash"]],
    ),
    "marker-without-pattern": (
        [("pattern = '\\[probe\\] algo=None'\n", "")],
        [[":28: failure_markers[0].pattern: required key is missing"]],
    ),
    "revisions-conflict": (
        [
            ('model = "lab/tiny-model"', 'model = "lab/tiny-model"\nmodel_revision = "aaa"'),
            ('repo = "lab/tiny-model"', 'repo = "lab/tiny-model"\nrevision = "bbb"'),
        ],
        [[":5: lab/tiny-model is pinned to two revisions (aaa, bbb); pin one"]],
    ),
    "empty-blocked": (
        [('engine = "vllm"', 'engine = "vllm"\nblocked = " "')],
        [[":2: blocked is empty", "say why"]],
    ),
    "smoke-max-tokens-zero": (
        [("max_tokens = 8", "max_tokens = 0")],
        [[":33: smoke.max_tokens:", "greater than or equal to 1"]],
    ),
    # Stops at the first problem: the file does not parse, so there are no keys to check.
    "syntax-error": (
        [('name = "Tiny test recipe"', 'name = "Tiny test recipe'), ("required_nodes = 2", "x")],
        [[":2:8: the string opened on line 2 is never closed", "checked once this is fixed"]],
    ),
    "image-dir-outside-images": (
        [
            (
                'docker_image = "lab/vllm-standin:latest"',
                'docker_image = "x"\ndocker_image_dir = "../x"',
            )
        ],
        [[":4: docker_image_dir '../x' must name a directory under images/"]],
    ),
    "key-set-twice": (
        [("required_nodes = 2", "required_nodes = 2\nrequired_nodes = 3")],
        [[":6:1: key 'required_nodes' is set twice (first on line 5)", "keep one"]],
    ),
    # Several problems in one file: every one is reported, in file order.
    "typo-and-duplicate-flag": (
        [
            ("tensor_parallel_size", "tensor_paralel_size"),
            ('"--max-model-len", "4096",', '"--max-model-len", "4096", "--max_model_len=8192",'),
        ],
        [[":6: unknown key 'tensor_paralel_size'"], [":9: --max_model_len is given twice"]],
    ),
    "type-error-json-and-mount": (
        [
            ("required_nodes = 2", 'required_nodes = "2"'),
            ('"num_speculative_tokens": 2}', '"num_speculative_tokens": 2,}'),
            ('host = "~/.cache/vllm"', 'host = "cache/vllm"'),
        ],
        [
            [":5: required_nodes:", "without quotes"],
            [":11: --speculative-config: invalid JSON"],
            [":25: extra_mounts[0].host 'cache/vllm'"],
        ],
    ),
    "backend-env-regex-blocked": (
        [
            ('engine = "vllm"', 'engine = "vllm"\nblocked = ""'),
            ('distributed_backend = "mp"', 'distributed_backend = "nccl"'),
            ('OMP_NUM_THREADS = "2"', 'VLLM_HOST_IP = "10.0.0.1"'),
            ("pattern = '\\[probe\\] algo=None'", "pattern = '(unclosed'"),
        ],
        [
            [":2: blocked is empty"],
            [":8: distributed_backend:", "'nccl'"],
            [":16: env.VLLM_HOST_IP is set per node"],
            [":31: failure_markers[0].pattern", "not a valid regular expression"],
        ],
    ),
    "wrong-table-stray-and-divisibility": (
        [
            ("required_nodes = 2", "required_nodes = 4"),
            ('"--served-model-name", "tiny",', '"--served-model-name", "tiny", "", "oops",'),
            ("[smoke]\n", "[smoke]\nread_only = true\n"),
        ],
        [
            [":5: required_nodes = 4 does not divide"],
            [":10: args[4] is empty"],
            [":10: stray value 'oops'"],
            [":33: unknown key 'smoke.read_only'", "belongs in [[extra_mounts]]"],
        ],
    ),
    "missing-key-and-plan-flag": (
        [
            ('docker_image = "lab/vllm-standin:latest"\n', ""),
            ('"--max-model-len", "4096",', '"--max-model-len", "4096", "--revision", "main",'),
            ('container = "/root/.cache/vllm"', 'container = "cache"'),
        ],
        [
            ["recipe.toml: docker_image: required key is missing"],
            [":8: --revision is set by the plan from model_revision"],
            [":25: extra_mounts[0].container 'cache'"],
        ],
    ),
}


def edited(text: str, edits: list[Edit]) -> str:
    for old, new in edits:
        assert text.count(old) == 1, f"{old!r} is not in the good file once"
        text = text.replace(old, new)
    return text


def expect_problems(
    load: object, path: Path, error: type[SparkDeployError], problems: list[list[str]]
) -> None:
    """Every problem's fragments on one line of its own, in this order (file order)."""
    with pytest.raises(error) as caught:
        load(path)  # type: ignore[operator]
    lines = str(caught.value).splitlines()
    assert all(line.startswith(str(path)) for line in lines), lines
    assert len(lines) == len(problems), lines
    for line, fragments in zip(lines, problems, strict=True):
        for fragment in fragments:
            assert fragment in line, (fragment, line)


def test_the_good_recipe_loads(tmp_path: Path) -> None:
    path = tmp_path / "recipe.toml"
    path.write_text(GOOD_RECIPE)
    assert load_recipe(path).served_model_name == "tiny"


@pytest.mark.parametrize("name", sorted(RECIPE_CASES))
def test_bad_recipe(tmp_path: Path, name: str) -> None:
    edits, problems = RECIPE_CASES[name]
    path = tmp_path / "recipe.toml"
    path.write_text(edited(GOOD_RECIPE, edits))
    expect_problems(load_recipe, path, RecipeError, problems)


def test_crlf_recipe_counts_lines_like_lf(tmp_path: Path) -> None:
    path = tmp_path / "recipe.toml"
    text = edited(GOOD_RECIPE, [("tensor_parallel_size", "tensor_paralel_size")])
    path.write_bytes(text.replace("\n", "\r\n").encode())
    expect_problems(load_recipe, path, RecipeError, [[":6: unknown key 'tensor_paralel_size'"]])


def test_bom_recipe_loads_and_counts_columns_after_it(tmp_path: Path) -> None:
    path = tmp_path / "recipe.toml"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD_RECIPE.encode())
    assert load_recipe(path).model == "lab/tiny-model"
    path.write_bytes(b"\xef\xbb\xbf" + b"engine = vllm\n")
    expect_problems(load_recipe, path, RecipeError, [[":1:10: not a valid value"]])


def test_non_utf8_recipe_names_the_line_and_stops(tmp_path: Path) -> None:
    path = tmp_path / "recipe.toml"
    path.write_bytes(GOOD_RECIPE.replace("Tiny", "Caf\xe9").encode("latin-1"))
    expect_problems(
        load_recipe, path, RecipeError, [[":2: not UTF-8 text", "save it as UTF-8", "checked once"]]
    )


def test_a_recipe_that_is_an_inventory(tmp_path: Path) -> None:
    path = tmp_path / "recipe.toml"
    path.write_text(CONTRACT_INVENTORY)
    expect_problems(
        load_recipe, path, RecipeError, [[":16: nodes: this is a cluster inventory, not a recipe"]]
    )


def test_an_inventory_that_is_a_recipe(tmp_path: Path) -> None:
    path = tmp_path / "lab.toml"
    path.write_text(GOOD_RECIPE)
    expect_problems(
        load_cluster, path, InventoryError, [[":4: model: this is a recipe, not a cluster"]]
    )


INVENTORY_CASES: dict[str, tuple[list[Edit], list[list[str]]]] = {
    "node-name-twice": (
        [('name = "node2"', 'name = "node1"')],
        [[":21: node name node1 is already used by nodes[0]", ":16)", "needs its own"]],
    ),
    "fabric-ip-twice": (
        [('fabric_ip = "10.77.0.12"', 'fabric_ip = "10.77.0.11"')],
        [[":21: fabric_ip 10.77.0.11 is already used by nodes[0]"]],
    ),
    "host-port-twice": (
        [('host = "10.77.0.12"', 'host = "10.77.0.11"'), ("port = 2222", "port = 22")],
        [[":21: SSH host:port 10.77.0.11:22 is already used by nodes[0]"]],
    ),
    "relative-nas-path": (
        [('hf_cache = "/srv/nas/hf-cache"', 'hf_cache = "nas/hf-cache"')],
        [[":31: nas.hf_cache 'nas/hf-cache' must be an absolute path"]],
    ),
    "relative-node-path": (
        [('composed_root = "/var/tmp/sparkdeploy/composed"', 'composed_root = "composed"')],
        [[":35: node_paths.composed_root 'composed' must be an absolute path"]],
    ),
    # A key inventories had and no longer read: refused with what to do, the rest still checked.
    "engram-root-not-read": (
        [
            (
                'composed_root = "/var/tmp/sparkdeploy/composed"',
                'engram_root = "/var/tmp/engram-local"\ncomposed_root = "composed"',
            )
        ],
        [
            [
                ":35: node_paths.engram_root is not read:",
                "[[composed_model.local_files]] host path",
                "remove the key",
            ],
            [":36: node_paths.composed_root 'composed' must be an absolute path"],
        ],
    ),
    "key-in-wrong-table": (
        [('user = "root"', 'user = "root"\nfabric_netdev = "eth0"')],
        [[":6: unknown key 'ssh.fabric_netdev'", "[node_defaults] or [[nodes]]"]],
    ),
    "port-as-string": (
        [("port = 22\n", 'port = "22"\n')],
        [[":6: ssh.port:", "write it without quotes"]],
    ),
    "port-out-of-range": (
        [("port = 2222", "port = 70000")],
        [[":26: nodes[1].port:", "less than or equal to 65535"]],
    ),
    "bad-node-name": (
        [('name = "node1"', 'name = "node 1"')],
        [[":17: nodes[0].name: 'node 1' is not a usable node name"]],
    ),
    "bad-gid": (
        [("gid_index = 3", 'gid_index = "3"')],
        [[":28: nodes[1].gid_index", "an integer ≥ 0, without quotes"]],
    ),
    "empty-hcas": (
        [('roce_hcas = ["rocep1s0f1"]', "roce_hcas = []")],
        [[':27: nodes[1].roce_hcas: must be "auto" or a non-empty list']],
    ),
    "profile-per-node-var": (
        [('NCCL_IB_DISABLE = "0"', 'NCCL_IB_HCA = "mlx5_0"')],
        [[":44: nccl.ds4.NCCL_IB_HCA is set per node", "remove it from the profile"]],
    ),
    "profile-bad-variable": (
        [('NCCL_IB_DISABLE = "0"', '"NCCL IB" = "0"')],
        [[":44: nccl.ds4: 'NCCL IB' is not an env variable name"]],
    ),
    "no-netdev": (
        [('fabric_netdev = "enp1s0f1np1"\n', "")],
        [[":15: node node1 has no fabric_netdev"], [":20: node node2 has no fabric_netdev"]],
    ),
    # Several problems at once, each reported.
    "name-ip-and-nas": (
        [
            ('name = "node2"', 'name = "node1"'),
            ('fabric_ip = "10.77.0.12"', 'fabric_ip = "10.77.0.11"'),
            ('runs_dir = "/srv/nas/runs"', 'runs_dir = "runs"'),
        ],
        [
            [":21: node name node1 is already used"],
            [":21: fabric_ip 10.77.0.11 is already used"],
            [":32: nas.runs_dir 'runs' must be an absolute path"],
        ],
    ),
    "typo-duplicate-and-profile": (
        [
            ("[docker]", "[dokcer]"),
            ('fabric_ip = "10.77.0.12"', 'fabric_ip = "10.77.0.11"'),
            ('NCCL_IB_DISABLE = "0"', 'VLLM_HOST_IP = "1.2.3.4"'),
        ],
        [
            [":21: fabric_ip 10.77.0.11 is already used"],
            [":37: unknown key 'dokcer': did you mean 'docker'?"],
            [":44: nccl.ds4.VLLM_HOST_IP is set per node"],
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(INVENTORY_CASES))
def test_bad_inventory(tmp_path: Path, name: str) -> None:
    edits, problems = INVENTORY_CASES[name]
    path = tmp_path / "lab.toml"
    path.write_text(edited(CONTRACT_INVENTORY, edits))
    expect_problems(load_cluster, path, InventoryError, problems)


def test_at_least_fifty_bad_cases() -> None:
    # the cases above plus the CRLF, BOM, non-UTF-8 and wrong-kind tests, and fixtures/bad/
    several = [c for c in [*RECIPE_CASES.values(), *INVENTORY_CASES.values()] if len(c[1]) > 1]
    assert len(RECIPE_CASES) + len(INVENTORY_CASES) + 5 >= 50
    assert len(several) >= 5
