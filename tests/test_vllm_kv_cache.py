"""A model's KV cache per token as vLLM sizes it (sparkdeploy.vllm.kv_cache), checked against the
module's formula worked by hand: a full-attention layer holds, per token and rank,
num_kv_heads x (K + V head sizes) x dtype bytes, with max(1, kv_heads // tp) heads a rank; an MLA
layer one unsplit latent of kv_lora_rank + qk_rope_head_dim. (tests/test_fit.py checks the sums
against what real vLLM logged, and DeepSeek's MLA with fp8.)"""

from __future__ import annotations

import re
from typing import Any

import pytest

from sparkdeploy.vllm.kv_cache import (
    FP8_DS_MLA_TOKEN_BYTES,
    KvCacheError,
    KvGeometry,
    config_value,
    model_dtype_bytes,
)

KIB = 1024

# Llama 3.1 8B's config.json (the figures that size its KV cache): grouped-query attention,
# 32 query heads sharing 8 KV heads of 4096 / 32 = 128 dims.
LLAMA_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}

# An MLA model's figures (DeepSeek V3's): 512 + 64 latent dims whatever the heads.
MLA: dict[str, Any] = {
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
}


def test_a_gqa_model_is_read_from_its_config() -> None:
    assert KvGeometry.from_config(LLAMA_8B) == KvGeometry(
        layers=32, kv_heads=8, head_dim=128, mla_latent=None
    )


def test_llama_8b_holds_128_kib_a_token_in_bf16() -> None:
    # 32 layers x 8 KV heads x (128 K + 128 V) x 2 bytes: the well-known 128 KiB a token.
    geometry = KvGeometry.from_config(LLAMA_8B)
    assert geometry.layer_token_bytes(1, "auto", 2) == 8 * (128 + 128) * 2 == 4096
    assert geometry.token_bytes(32, 1, "auto", 2) == 32 * 4096 == 128 * KIB


def test_tensor_parallelism_splits_the_kv_heads_over_the_ranks() -> None:
    geometry = KvGeometry.from_config(LLAMA_8B)
    assert [geometry.kv_heads_per_rank(tp) for tp in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert geometry.layer_token_bytes(2, "auto", 2) == 4 * 256 * 2
    assert geometry.layer_token_bytes(8, "auto", 2) == 1 * 256 * 2


def test_ranks_beyond_the_kv_heads_each_keep_a_whole_head() -> None:
    # vLLM replicates a KV head when tp > num_kv_heads: every rank holds one, never zero.
    geometry = KvGeometry.from_config(LLAMA_8B)
    assert geometry.kv_heads_per_rank(16) == 1
    assert geometry.layer_token_bytes(16, "auto", 2) == geometry.layer_token_bytes(8, "auto", 2)


def test_a_pipeline_stage_holds_only_its_layers() -> None:
    geometry = KvGeometry.from_config(LLAMA_8B)
    assert geometry.token_bytes(10, 1, "auto", 2) == 10 * 4096
    assert geometry.token_bytes(0, 1, "auto", 2) == 0


@pytest.mark.parametrize(
    ("kv_cache_dtype", "model_bytes", "per_layer"),
    [
        ("auto", 2, 8 * 256 * 2),
        ("auto", 4, 8 * 256 * 4),
        ("fp8", 2, 8 * 256 * 1),
        ("fp8_e4m3", 2, 8 * 256 * 1),
        ("fp8_e5m2", 2, 8 * 256 * 1),
        ("int8", 2, 8 * 256 * 1),
        ("bfloat16", 4, 8 * 256 * 2),
        ("float32", 2, 8 * 256 * 4),
        # 1-byte values and two float32 scales (K and V) a head
        ("fp8_per_token_head", 2, 8 * 256 * 1 + 2 * 8 * 4),
        ("int8_per_token_head", 2, 8 * 256 * 1 + 2 * 8 * 4),
        # fp4 values two a byte, an fp8 scale per 16 values, for K and V
        ("nvfp4", 2, 8 * 2 * (128 // 2 + 128 // 16)),
    ],
)
def test_the_kv_cache_dtype_sets_the_bytes_a_value(
    kv_cache_dtype: str, model_bytes: int, per_layer: int
) -> None:
    geometry = KvGeometry.from_config(LLAMA_8B)
    assert geometry.layer_token_bytes(1, kv_cache_dtype, model_bytes) == per_layer
    assert geometry.token_bytes(32, 1, kv_cache_dtype, model_bytes) == 32 * per_layer


def test_an_unknown_kv_cache_dtype_is_refused_by_name() -> None:
    geometry = KvGeometry.from_config(LLAMA_8B)
    with pytest.raises(KvCacheError, match=re.escape("--kv-cache-dtype fp6: its size per value")):
        geometry.layer_token_bytes(1, "fp6", 2)


def test_a_model_without_kv_heads_has_one_kv_head_per_attention_head() -> None:
    mha = {"num_hidden_layers": 2, "num_attention_heads": 12, "hidden_size": 768}
    geometry = KvGeometry.from_config(mha)
    assert (geometry.kv_heads, geometry.head_dim) == (12, 64)
    assert geometry.token_bytes(2, 1, "auto", 2) == 2 * 12 * (64 + 64) * 2


def test_a_declared_head_dim_wins_over_hidden_size_by_heads() -> None:
    # Gemma-like: 16 heads of 256 dims in a hidden size of 3072 (which would give 192).
    config = {
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "hidden_size": 3072,
        "head_dim": 256,
    }
    assert KvGeometry.from_config(config).layer_token_bytes(1, "auto", 2) == 8 * 512 * 2


def test_a_multimodal_config_is_read_from_its_text_config() -> None:
    config = {
        "architectures": ["SomeVisionForConditionalGeneration"],
        "num_hidden_layers": 27,  # the vision tower's, at the top level
        "vision_config": {"hidden_size": 1152},
        "text_config": {**LLAMA_8B, "num_hidden_layers": 32, "torch_dtype": None},
        "torch_dtype": "float16",
    }
    geometry = KvGeometry.from_config(config)
    assert (geometry.layers, geometry.kv_heads, geometry.head_dim) == (32, 8, 128)
    assert config_value(config, "num_hidden_layers") == 32
    assert config_value(config, "torch_dtype") == "float16"  # None in text_config: the top's
    assert config_value(config, "no_such_key") is None
    assert config_value({"text_config": "not a table", "a": 1}, "a") == 1


def test_an_mla_token_is_one_latent_a_layer_whatever_the_tensor_parallelism() -> None:
    geometry = KvGeometry.from_config(MLA)
    assert geometry.mla_latent == 512 + 64
    assert [geometry.kv_heads_per_rank(tp) for tp in (1, 2, 8)] == [1, 1, 1]
    for tp in (1, 2, 8):
        assert geometry.layer_token_bytes(tp, "auto", 2) == 576 * 2
        assert geometry.layer_token_bytes(tp, "fp8", 2) == 576
        assert geometry.layer_token_bytes(tp, "fp8_ds_mla", 2) == FP8_DS_MLA_TOKEN_BYTES == 656


def test_an_mla_model_without_a_rope_part_has_the_lora_rank_as_its_latent() -> None:
    geometry = KvGeometry.from_config({**MLA, "qk_rope_head_dim": None})
    assert geometry.mla_latent == 512
    assert geometry.layer_token_bytes(4, "bfloat16", 2) == 1024


def test_an_mla_cache_has_no_fp4_layout() -> None:
    with pytest.raises(KvCacheError, match="nvfp4"):
        KvGeometry.from_config(MLA).layer_token_bytes(1, "nvfp4", 2)


@pytest.mark.parametrize("missing", ["num_hidden_layers", "num_attention_heads"])
def test_a_config_without_layer_or_head_counts_is_refused_naming_what_is_missing(
    missing: str,
) -> None:
    config = {key: value for key, value in LLAMA_8B.items() if key != missing}
    with pytest.raises(KvCacheError, match=re.escape(f"config.json has no {missing}") + "$"):
        KvGeometry.from_config(config)


def test_a_config_without_either_count_names_both() -> None:
    with pytest.raises(
        KvCacheError, match=re.escape("config.json has no num_hidden_layers or num_attention_heads")
    ):
        KvGeometry.from_config({"hidden_size": 4096})


def test_a_config_without_head_dim_or_hidden_size_is_refused() -> None:
    with pytest.raises(KvCacheError, match="neither head_dim nor hidden_size"):
        KvGeometry.from_config({"num_hidden_layers": 2, "num_attention_heads": 4})


@pytest.mark.parametrize("value", [0, -8, "8", 8.0, True])
def test_a_count_that_is_not_a_positive_integer_is_refused(value: object) -> None:
    with pytest.raises(
        KvCacheError, match=re.escape(f"num_key_value_heads is {value!r}, not a positive")
    ):
        KvGeometry.from_config({**LLAMA_8B, "num_key_value_heads": value})


@pytest.mark.parametrize(
    ("config", "dtype", "size"),
    [
        ({"torch_dtype": "bfloat16"}, "auto", 2),
        # a float32 checkpoint is served in 16 bits unless --dtype says otherwise
        ({"torch_dtype": "float32"}, "auto", 2),
        ({"text_config": {"dtype": "float32"}}, "auto", 2),
        ({}, "auto", 2),
        ({"torch_dtype": "bfloat16"}, "float32", 4),
        ({"torch_dtype": "bfloat16"}, "float", 4),
        ({"torch_dtype": "float32"}, "half", 2),
        ({"torch_dtype": "float32"}, "bfloat16", 2),
    ],
)
def test_the_model_dtype_is_the_flag_else_the_config_in_at_most_16_bits(
    config: dict[str, Any], dtype: str, size: int
) -> None:
    assert model_dtype_bytes(config, dtype) == size


def test_an_unknown_dtype_flag_is_refused_with_the_choices() -> None:
    with pytest.raises(KvCacheError, match=r"--dtype int4: not one of float32, .*bfloat16 or auto"):
        model_dtype_bytes(LLAMA_8B, "int4")
