"""A model's KV cache per token, as vLLM sizes it (standard library only: the engine stand-in,
copied into the lab's image, prints its KV figures with it).

vLLM (vllm-project/vllm `vllm/v1/kv_cache_interface.py`): a full-attention layer's page of
`block_size` tokens is block_size x num_kv_heads x (head_size + head_size_v) x dtype size bytes
(K and V); an MLA layer's is block_size x head_size x dtype size with one latent "head"
(kv_lora_rank + qk_rope_head_dim) that tensor parallelism does not split, and `fp8_ds_mla`
packs a token in 656 bytes. KV heads per rank are max(1, heads // tp) (`vllm/config/model.py`,
get_num_kv_heads). docs/field.md#memory-fit has the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# vLLM's names for float dtypes (vllm/utils/torch_utils.py, STR_DTYPE_TO_TORCH_DTYPE).
FLOAT_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
_ONE_BYTE_KV = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "int8")
# Per-token-head scales: two float32 per KV head and token, beside the 1-byte values
# (AttentionSpec.page_size_bytes).
_PER_TOKEN_HEAD_KV = ("int8_per_token_head", "fp8_per_token_head")
FP8_DS_MLA_TOKEN_BYTES = 656  # MLAAttentionSpec.real_page_size_bytes, per token and layer


class KvCacheError(ValueError):
    """The config lacks what sizing its KV cache needs, or a dtype's size is not known."""


def config_value(config: Mapping[str, Any], key: str) -> Any:
    """A value of the language model's config: its text_config first, then the top level."""
    nested = config.get("text_config")
    for section in (nested if isinstance(nested, Mapping) else {}, config):
        if key in section and section[key] is not None:
            return section[key]
    return None


def model_dtype_bytes(config: Mapping[str, Any], dtype: str = "auto") -> int:
    """Bytes per element the engine computes in: --dtype, else the config's dtype, a float32
    config downcast to 16 bits (vllm/config/model.py, _resolve_auto_dtype)."""
    if dtype != "auto":
        if dtype not in FLOAT_BYTES:
            raise KvCacheError(f"--dtype {dtype}: not one of {', '.join(FLOAT_BYTES)} or auto")
        return FLOAT_BYTES[dtype]
    declared = config_value(config, "dtype") or config_value(config, "torch_dtype")
    size = FLOAT_BYTES.get(str(declared), 2)
    return 2 if size == 4 else size


@dataclass(frozen=True)
class KvGeometry:
    """What sizes one token's KV cache in one layer."""

    layers: int
    kv_heads: int
    head_dim: int
    mla_latent: int | None  # kv_lora_rank + qk_rope_head_dim for an MLA model

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> KvGeometry:
        def number(key: str) -> int | None:
            value = config_value(config, key)
            if value is None:
                return None
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise KvCacheError(f"config.json {key} is {value!r}, not a positive integer")
            return value

        layers = number("num_hidden_layers")
        heads = number("num_attention_heads")
        if layers is None or heads is None:
            missing = [k for k in ("num_hidden_layers", "num_attention_heads") if number(k) is None]
            raise KvCacheError(f"config.json has no {' or '.join(missing)}")
        hidden = number("hidden_size")
        head_dim = number("head_dim") or (hidden // heads if hidden else None)
        if head_dim is None:
            raise KvCacheError("config.json has neither head_dim nor hidden_size")
        lora, rope = number("kv_lora_rank"), number("qk_rope_head_dim")
        return cls(
            layers=layers,
            kv_heads=number("num_key_value_heads") or heads,
            head_dim=head_dim,
            mla_latent=lora + (rope or 0) if lora else None,
        )

    def kv_heads_per_rank(self, tp: int) -> int:
        return 1 if self.mla_latent else max(1, self.kv_heads // tp)

    def layer_token_bytes(self, tp: int, kv_cache_dtype: str, model_bytes: int) -> int:
        """One token's KV cache in one layer on one rank."""
        heads = self.kv_heads_per_rank(tp)
        if self.mla_latent:
            if kv_cache_dtype == "fp8_ds_mla":
                return FP8_DS_MLA_TOKEN_BYTES
            return self.mla_latent * _element_bytes(kv_cache_dtype, model_bytes)
        if kv_cache_dtype == "nvfp4":
            # fp4 values, two a byte, and an fp8 scale per 16 (nvfp4_kv_cache_full_dim), K and V
            return heads * 2 * (self.head_dim // 2 + self.head_dim // 16)
        values = 2 * heads * self.head_dim * _element_bytes(kv_cache_dtype, model_bytes)
        scales = 2 * heads * 4 if kv_cache_dtype in _PER_TOKEN_HEAD_KV else 0
        return values + scales

    def token_bytes(self, layers: int, tp: int, kv_cache_dtype: str, model_bytes: int) -> int:
        """One token's KV cache over `layers` layers on one rank."""
        return layers * self.layer_token_bytes(tp, kv_cache_dtype, model_bytes)


def _element_bytes(kv_cache_dtype: str, model_bytes: int) -> int:
    if kv_cache_dtype == "auto":
        return model_bytes
    if kv_cache_dtype in _ONE_BYTE_KV or kv_cache_dtype in _PER_TOKEN_HEAD_KV:
        return 1
    if kv_cache_dtype in FLOAT_BYTES:
        return FLOAT_BYTES[kv_cache_dtype]
    raise KvCacheError(f"--kv-cache-dtype {kv_cache_dtype}: its size per value is not known here")
