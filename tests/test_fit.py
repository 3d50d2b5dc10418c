"""The fit check (sparkdeploy.steps.fit, sparkdeploy.spec.memory, sparkdeploy.vllm.kv_cache)
without a lab: its estimate against what real vLLM 0.32 logged for the lab's model, its refusals and
warnings."""

from __future__ import annotations

import ast
import re
import shutil
import struct
from pathlib import Path

import pytest

from lab.tinymodel import EngramSpec, generate_repo
from sparkdeploy.errors import FitError, RecipeError
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.memory import human_readable_int, read_memory_flags
from sparkdeploy.spec.plan import Plan, make_plan
from sparkdeploy.spec.recipe import Recipe
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.steps.fit import estimate, fit_report, pp_layer_ranges, read_model
from sparkdeploy.vllm.args import normalise_args
from sparkdeploy.vllm.kv_cache import FP8_DS_MLA_TOKEN_BYTES, KvGeometry

GIB = 1 << 30
FIXTURES = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu"
TINY_LLAMA_CHAT = FIXTURES / "tiny-llama-chat"
# What the real boots printed (tests/fixtures/vllm-0.32-cpu/README.md).
_ARGS = re.compile(r"non-default args: (\{.*\})")
_KV_SIZE = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens")
_CONCURRENCY = re.compile(r"per request: ([\d.]+)x")
_PINNED = re.compile(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache")
_AUTO = re.compile(
    r"Auto set \(([\d.]+)/([\d.]+)\) GiB for KV cache .* ([\d.]+) GiB memory was consumed by "
    r"non-kv usages"
)
_CHECKPOINT = re.compile(r"Checkpoint size: ([\d.]+) GiB")


def inventory(directory: Path, *, memory_gib: float = 121.63, overhead_gib: float = 4.0) -> Path:
    """A 2-node inventory (names only: nothing is reached) with the given node memory."""
    nodes = "".join(
        f'[[nodes]]\nname = "n{i}"\nhost = "10.0.0.{i}"\nfabric_ip = "10.0.0.{i}"\n\n'
        for i in (1, 2)
    )
    path = directory / "fit-cluster.toml"
    path.write_text(
        'name = "fit"\n[ssh]\nidentity_file = "key"\n'
        f'[node_defaults]\nfabric_netdev = "eth0"\nmemory_gib = {memory_gib}\n'
        f"engine_overhead_gib = {overhead_gib}\n\n{nodes}"
        f'[nas]\nhf_cache = "{directory / "hf-cache"}"\nruns_dir = "/srv/runs"\n'
    )
    return path


def snapshot(hf_cache: Path, repo: str) -> Path:
    """An empty snapshot of repo in an HF cache layout, refs/main pointing at it."""
    storage = hf_cache / ("models--" + repo.replace("/", "--"))
    path = storage / "snapshots" / ("a" * 40)
    path.mkdir(parents=True)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text("a" * 40)
    return path


def cache_tiny_llama_chat(hf_cache: Path) -> None:
    """lab/tiny-llama-chat as the NAS holds it, but for its tensors: the real config.json and
    safetensors header, the rest of the file a hole (the fit check reads headers only)."""
    path = snapshot(hf_cache, "lab/tiny-llama-chat")
    shutil.copy(TINY_LLAMA_CHAT / "config.json", path)
    header = (TINY_LLAMA_CHAT / "model.safetensors.header.json").read_bytes()
    data_end = max(int(end) for _, end in re.findall(rb'"data_offsets":\[(\d+),(\d+)\]', header))
    with open(path / "model.safetensors", "wb") as shard:
        shard.write(struct.pack("<Q", len(header)) + header)
        shard.truncate(8 + len(header) + data_end)


def recipe_of_log(log: str) -> Recipe:
    """The recipe a real boot's `non-default args` line describes."""
    args = ast.literal_eval(_ARGS.search(log).group(1))  # type: ignore[union-attr]
    tp = args.get("tensor_parallel_size", 1)
    flags = ["--dtype", args["dtype"], "--max-model-len", str(args["max_model_len"])]
    if "gpu_memory_utilization" in args:
        flags += ["--gpu-memory-utilization", str(args["gpu_memory_utilization"])]
    pinned = _PINNED.search(log)
    return Recipe(
        name="from a log",
        docker_image="lab/vllm-cpu:0.32.0",
        model="lab/tiny-llama-chat",
        required_nodes=tp,
        tensor_parallel_size=tp,
        args=flags,
        env={"VLLM_CPU_KVCACHE_SPACE": f"{float(pinned.group(1)):g}"} if pinned else {},
    )


def plan_for(recipe: Recipe, cluster_file: Path) -> Plan:
    return make_plan(recipe, load_cluster(cluster_file))


@pytest.mark.parametrize("log_name", ["serve.log", "mn-head.log"])
def test_the_kv_cache_estimate_is_what_real_vllm_logged_for_a_pinned_cache(
    tmp_path: Path, log_name: str
) -> None:
    log = (FIXTURES / log_name).read_text()
    cache_tiny_llama_chat(tmp_path / "hf-cache")
    report = fit_report(plan_for(recipe_of_log(log), inventory(tmp_path)))
    tokens, max_len = (int(n.replace(",", "")) for n in _KV_SIZE.search(log).groups())  # type: ignore[union-attr]
    assert report.max_model_len == max_len
    assert {node.kv_tokens for node in report.nodes} == {tokens}
    assert f"{tokens / max_len:.2f}" == _CONCURRENCY.search(log).group(1)  # type: ignore[union-attr]


def test_the_estimate_follows_a_real_boot_that_sized_its_own_kv_cache(tmp_path: Path) -> None:
    """vLLM's CPU backend gave the KV cache utilization x the node's memory less what the worker
    held (its RSS): the same subtraction as the fit check's, with the logged figures put in."""
    log = (FIXTURES / "serve-auto-kv.log").read_text()
    kv_gib, total_gib, consumed_gib = (float(n) for n in _AUTO.search(log).groups())  # type: ignore[union-attr]
    cache_tiny_llama_chat(tmp_path / "hf-cache")
    recipe = recipe_of_log(log)
    plan = plan_for(recipe, inventory(tmp_path, memory_gib=total_gib, overhead_gib=consumed_gib))
    [node] = fit_report(plan).nodes
    tokens = int(_KV_SIZE.search(log).group(1).replace(",", ""))  # type: ignore[union-attr]
    # The log rounds its GiB to two decimals: the token counts agree to that precision.
    assert node.kv_tokens == pytest.approx(tokens, rel=0.01)
    assert node.kv_cache_bytes / GIB == pytest.approx(kv_gib, abs=0.01)
    assert node.kv_bytes_per_token * tokens / GIB == pytest.approx(kv_gib, abs=0.005)
    # The weights the estimate counts are the checkpoint's bytes the log reports.
    checkpoint_gib = float(_CHECKPOINT.search(log).group(1))  # type: ignore[union-attr]
    assert f"{node.weights_bytes / GIB:.2f}" == f"{checkpoint_gib:.2f}"


def test_weights_are_split_over_tensor_parallel_ranks_but_1d_tensors(tmp_path: Path) -> None:
    cache_tiny_llama_chat(tmp_path / "hf-cache")
    model = read_model(str(tmp_path / "hf-cache"), "lab/tiny-llama-chat", None)
    total = sum(info.end - info.begin for info in model.tensors)
    norms = sum(info.end - info.begin for info in model.tensors if len(info.shape) == 1)
    assert total == 2_361_856  # every tensor of the real checkpoint, from its header
    log = (FIXTURES / "mn-head.log").read_text()
    report = fit_report(plan_for(recipe_of_log(log), inventory(tmp_path)))
    assert [node.weights_bytes for node in report.nodes] == [(total - norms) // 2 + norms] * 2


def test_a_model_not_in_the_nas_cache_is_named_with_the_fix(tmp_path: Path) -> None:
    recipe = recipe_of_log((FIXTURES / "serve.log").read_text())
    with pytest.raises(
        FitError, match=r"lab/tiny-llama-chat@main is not in the HF cache .*prefetch"
    ):
        fit_report(plan_for(recipe, inventory(tmp_path)))


def long_context_recipe(**changes: object) -> Recipe:
    """A recipe that looks harmless: no --max-model-len, so vLLM takes the model's context."""
    fields: dict[str, object] = {
        "name": "long context",
        "docker_image": "img:1",
        "model": "lab/tiny-chat-4m",
        "required_nodes": 1,
        "args": ["--served-model-name", "long"],
        **changes,
    }
    return Recipe.model_validate(fields)


def cache_long_context_model(tmp_path: Path, context: int) -> None:
    """A lab tiny chat model whose config says `context` tokens, in an HF cache layout."""
    repo = generate_repo(
        tmp_path / "repos", "lab/tiny-chat-4m", total_bytes=1 << 20, context_length=context
    )
    path = snapshot(tmp_path / "hf-cache", "lab/tiny-chat-4m")
    for name in repo.files:
        shutil.copy(repo.path / name, path / name)


def test_a_model_whose_context_cannot_fit_is_refused_with_figures_and_knobs(
    tmp_path: Path,
) -> None:
    cache_long_context_model(tmp_path, 4 << 20)
    cluster = inventory(tmp_path, memory_gib=6.0, overhead_gib=2.0)
    report = fit_report(plan_for(long_context_recipe(), cluster))
    [node] = report.nodes
    # 2 layers x (K, V) x 8 KV heads x head_dim 64 x 2 bytes (bfloat16) a token
    assert node.kv_bytes_per_token == 4096
    assert node.kv_request_bytes == 16 * GIB
    assert node.verdict == "does not fit"
    refusal = report.refusal or ""
    for expected in (
        "recipe ",
        "node n1: weights 1.0 MiB + engine overhead 2.0 GiB + KV cache 16.0 GiB",
        "budget of 5.5 GiB (--gpu-memory-utilization 0.92 x the inventory's memory_gib 6 GiB)",
        "one request of 4,194,304 tokens needs 16.0 GiB",
        f"--max-model-len {node.kv_tokens} or lower",
        "--kv-cache-dtype fp8",
        "tensor_parallel_size",
    ):
        assert expected in refusal, refusal
    assert any("max_position_embeddings (4,194,304)" in note for note in report.notes)
    # The knob it names works: the same recipe with that max-model-len fits.
    fitted = long_context_recipe(args=["--max-model-len", str(node.kv_tokens)])
    assert fit_report(plan_for(fitted, cluster)).refusal is None


def test_a_tight_fit_and_a_short_concurrency_are_warned(tmp_path: Path) -> None:
    cache_long_context_model(tmp_path, 4 << 20)
    cluster = inventory(tmp_path, memory_gib=6.0, overhead_gib=2.0)
    plan = plan_for(long_context_recipe(args=["--max-model-len", "860K"]), cluster)
    report = fit_report(plan)
    assert report.refusal is None
    assert report.nodes[0].verdict == "tight"
    assert "under the 5% margin" in report.warnings[0]
    many = long_context_recipe(args=["--max-model-len", "256K", "--max-num-seqs", "8"])
    [warning] = fit_report(plan_for(many, cluster)).warnings
    assert "holds 3.5 requests of 262,144 tokens, fewer than --max-num-seqs 8" in warning


def test_a_pinned_kv_cache_is_checked_against_the_whole_node(tmp_path: Path) -> None:
    cache_long_context_model(tmp_path, 4096)
    cluster = inventory(tmp_path, memory_gib=6.0, overhead_gib=2.0)
    pinned = long_context_recipe(args=["--kv-cache-memory-bytes", "3G"])
    [node] = fit_report(plan_for(pinned, cluster)).nodes
    # vLLM ignores the utilization with a pinned cache: the budget is the node's 6 GiB.
    assert (node.budget_bytes, node.kv_cache_bytes, node.verdict) == (6 * GIB, 3 * GIB, "fits")
    too_big = long_context_recipe(args=["--kv-cache-memory-bytes", "5G"])
    refusal = fit_report(plan_for(too_big, cluster)).refusal or ""
    assert "budget of 6.0 GiB (the inventory's memory_gib 6 GiB: a pinned KV cache" in refusal
    assert "the pinned KV cache (--kv-cache-memory-bytes)" in refusal


def test_engram_tables_kept_on_disk_are_not_counted(tmp_path: Path) -> None:
    repo = generate_repo(
        tmp_path / "repos",
        "lab/tiny-dsv41",
        total_bytes=4 << 20,
        engram=EngramSpec(n_heads=3),
        tp_size=3,
    )
    path = snapshot(tmp_path / "hf-cache", "lab/tiny-dsv41")
    for name in repo.files:
        shutil.copy(repo.path / name, path / name)
    recipe = load_recipe(Path(__file__).parent.parent / "recipes" / "lab-dsv41-3x" / "recipe.toml")
    cluster = inventory(tmp_path)
    text = cluster.read_text().replace(
        "[nas]", '[[nodes]]\nname = "n3"\nhost = "10.0.0.3"\nfabric_ip = "10.0.0.3"\n\n[nas]'
    )
    cluster.write_text(text)
    report = fit_report(plan_for(recipe, cluster))
    dense = sum(
        info.end - info.begin
        for info in read_model(str(tmp_path / "hf-cache"), "lab/tiny-dsv41", None).tensors
        if ".engram." not in info.name
    )
    assert sum(node.weights_bytes for node in report.nodes) == pytest.approx(dense, rel=0.01)
    assert any("Engram tables stay on disk" in note for note in report.notes)


def test_vllm_reads_lengths_and_sizes_as_its_argparse_does() -> None:
    assert [human_readable_int(v) for v in ("4096", "1k", "1K", "25.6k", "512K", "3G")] == [
        4096,
        1000,
        1024,
        25600,
        524288,
        3 * GIB,
    ]
    with pytest.raises(
        ValueError, match=re.escape("invalid literal for int() with base 10: '1.5'")
    ):
        human_readable_int("1.5K")


def test_memory_flags_a_recipe_cannot_use_are_named_at_their_line(tmp_path: Path) -> None:
    flags, problems = read_memory_flags(
        normalise_args(["--max-model-len", "auto", "--gpu-memory-utilization", "1.5"]),
        {"VLLM_CPU_KVCACHE_SPACE": "lots"},
    )
    assert flags.max_model_len is None
    assert [key for key, _ in problems] == [("args", 2), ("env", "VLLM_CPU_KVCACHE_SPACE")]
    path = tmp_path / "bad" / "recipe.toml"
    path.parent.mkdir()
    path.write_text(
        'name = "bad"\ndocker_image = "i:1"\nmodel = "o/m"\nrequired_nodes = 1\n'
        'args = [\n  "--max-num-seqs",\n  "many",\n]\n'
    )
    with pytest.raises(
        RecipeError, match=r"recipe.toml:6: --max-num-seqs 'many' is not a whole number"
    ):
        load_recipe(path)


def test_pipeline_stages_take_layers_as_vllm_splits_them() -> None:
    # vllm/distributed/utils.py get_pp_indices: the remainder goes to all stages but the last.
    assert [len(r) for r in pp_layer_ranges(10, 4)] == [2, 3, 3, 2]
    assert [len(r) for r in pp_layer_ranges(5, 2)] == [3, 2]
    assert pp_layer_ranges(4, 1) == [range(4)]


def test_an_mla_cache_is_one_latent_per_token_that_tensor_parallelism_does_not_split() -> None:
    config = {
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "hidden_size": 7168,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
    }
    geometry = KvGeometry.from_config(config)
    assert geometry.token_bytes(61, 4, "fp8", 2) == 61 * 576
    assert geometry.token_bytes(61, 1, "auto", 2) == 61 * 576 * 2
    assert geometry.token_bytes(61, 4, "fp8_ds_mla", 2) == 61 * FP8_DS_MLA_TOKEN_BYTES


def test_a_config_without_layer_counts_cannot_be_sized(tmp_path: Path) -> None:
    cache_tiny_llama_chat(tmp_path / "hf-cache")
    recipe = recipe_of_log((FIXTURES / "serve.log").read_text())
    plan = plan_for(recipe, inventory(tmp_path))
    model = read_model(plan.nas_hf_cache, "lab/tiny-llama-chat", None)
    broken = type(model)(model.repo, model.snapshot, {"hidden_size": 128}, model.tensors)
    with pytest.raises(FitError, match=r'no num_hidden_layers.*skip=\["fit"\]'):
        estimate(plan, [broken])
