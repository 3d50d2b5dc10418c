"""Engram geometry (docs/field.md's DSV4.1 rules), safetensors headers and per-rank byte ranges."""

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sparkdeploy.errors import EngramError
from sparkdeploy.node.engram import (
    EngramGeometry,
    TensorInfo,
    is_prime,
    merge_ranges,
    rank_byte_ranges,
    read_safetensors_header,
)

DSV41_TEXT_CONFIG: dict[str, Any] = {
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
}


def small_config(**overrides: Any) -> dict[str, Any]:
    """vocab 100, 2 heads, n-grams up to 3, 2 layers: columns 101 103 107 109 | 113 127 131 137."""
    config: dict[str, Any] = {
        "engram_layer_ids": [0, 2],
        "engram_num_embeddings": [420, 508],
        "engram_max_ngram_size": 3,
        "engram_vocab_size": 100,
        "engram_n_heads": 2,
        "engram_head_dim": 64,
    }
    config.update(overrides)
    return config


def test_miller_rabin_agrees_with_trial_division() -> None:
    def by_trial_division(n: int) -> bool:
        return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))

    assert [n for n in range(3000) if is_prime(n)] == [
        n for n in range(3000) if by_trial_division(n)
    ]
    # Strong pseudoprimes to several small bases, and a large known prime.
    assert not is_prime(3215031751)
    assert not is_prime(3825123056546413051)
    assert is_prime(2**61 - 1)


def test_dsv41_columns_sum_to_the_configured_embeddings() -> None:
    geometry = EngramGeometry.from_config({"text_config": DSV41_TEXT_CONFIG})
    assert geometry is not None
    columns = geometry.column_sizes()
    assert [len(layer) for layer in columns] == [24, 24]
    assert [sum(layer) for layer in columns] == [384006168, 384016682]
    every_column = [size for layer in columns for size in layer]
    assert len(set(every_column)) == 48
    assert all(size > 16000000 - 1 and is_prime(size) for size in every_column)


def test_dsv41_tp4_rows_of_layer_1() -> None:
    geometry = EngramGeometry.from_config({"text_config": DSV41_TEXT_CONFIG})
    assert geometry is not None
    assert [geometry.rank_rows(0, rank, 4) for rank in range(4)] == [
        (0, 96000564),
        (96000564, 192001740),
        (192001740, 288003654),
        (288003654, 384006168),
    ]
    per_rank_gib = [
        (end - begin) * (256 + 256 // 32) / 2**30
        for begin, end in (geometry.rank_rows(0, rank, 4) for rank in range(4))
    ]
    assert all(round(gib, 2) == 23.60 for gib in per_rank_gib)


def test_prime_rule_restarts_each_order_at_the_vocabulary_and_skips_taken_primes() -> None:
    geometry = EngramGeometry.from_config(small_config())
    assert geometry is not None
    assert geometry.column_sizes() == [[101, 103, 107, 109], [113, 127, 131, 137]]


def test_rank_rows_split_columns_by_ceil_and_leave_surplus_ranks_empty() -> None:
    geometry = EngramGeometry.from_config(small_config())
    assert geometry is not None
    # 4 columns at TP3: part = 2, so ranks own columns [0,2), [2,4) and nothing.
    assert [geometry.rank_rows(1, rank, 3) for rank in range(3)] == [
        (0, 240),
        (240, 508),
        (508, 508),
    ]
    assert geometry.rank_rows(0, 0, 1) == (0, 420)
    with pytest.raises(EngramError, match="rank 3 of tensor-parallel size 3"):
        geometry.rank_rows(0, 3, 3)


def test_config_at_top_level_and_without_engram() -> None:
    assert EngramGeometry.from_config({"hidden_size": 8}) is None
    assert EngramGeometry.from_config({"text_config": {"hidden_size": 8}}) is None
    top_level = EngramGeometry.from_config(small_config())
    nested = EngramGeometry.from_config({"text_config": small_config(), "hidden_size": 8})
    assert top_level == nested
    assert top_level is not None
    assert top_level.layer_ids == (0, 2)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"engram_layer_ids": [1]}, "lacks engram_num_embeddings"),
        (small_config(engram_num_embeddings=[420]), "must pair up"),
        (small_config(engram_n_heads="2"), "engram_n_heads: expected a positive integer"),
        (small_config(engram_layer_ids=[0, True]), "expected a list of integers"),
        (small_config(engram_head_dim=48), "not a multiple of 32"),
        (small_config(engram_max_ngram_size=1), "leaves no n-gram order"),
        (small_config(engram_layer_ids=[2, 2]), "names a layer twice"),
    ],
)
def test_malformed_config_is_a_clear_error(config: dict[str, Any], message: str) -> None:
    with pytest.raises(EngramError, match=message):
        EngramGeometry.from_config(config)


def test_inconsistent_embeddings_are_a_clear_error() -> None:
    with pytest.raises(EngramError, match=r"layer 2: .* sum to 508 rows, but .* says 509"):
        EngramGeometry.from_config(small_config(engram_num_embeddings=[420, 509]))
    geometry = EngramGeometry(
        layer_ids=(0,),
        num_embeddings=(421,),
        max_ngram_size=3,
        vocab_size=100,
        n_heads=2,
        head_dim=64,
    )
    with pytest.raises(EngramError, match=r"layer 0: .* sum to 420 rows"):
        geometry.rank_rows(0, 0, 2)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A shard of the given 1-byte (dtype, shape) tensors; data byte i is i % 251."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = 1
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(i % 251 for i in range(offset)))


def small_shard(tmp_path: Path) -> Path:
    shard = tmp_path / "model-00002-of-00002.safetensors"
    write_safetensors(
        shard,
        {
            "layers.2.engram.embed.weight": ("F8_E4M3", [508, 64]),
            "layers.2.engram.embed.scale": ("F8_E8M0", [508, 2]),
        },
    )
    return shard


def test_header_offsets_are_absolute(tmp_path: Path) -> None:
    shard = small_shard(tmp_path)
    header_len, tensors, metadata = read_safetensors_header(shard)
    data_start = 8 + header_len
    assert metadata == {"format": "pt"}
    assert tensors["layers.2.engram.embed.weight"] == TensorInfo(
        "layers.2.engram.embed.weight", "F8_E4M3", (508, 64), data_start, data_start + 508 * 64
    )
    scale = tensors["layers.2.engram.embed.scale"]
    assert (scale.begin, scale.end, scale.row_width) == (
        data_start + 508 * 64,
        data_start + 508 * 66,
        2,
    )
    assert scale.end == shard.stat().st_size


def test_rank_byte_ranges_cover_the_rows_of_weight_and_scale(tmp_path: Path) -> None:
    geometry = EngramGeometry.from_config(small_config())
    assert geometry is not None
    header_len, tensors, _ = read_safetensors_header(small_shard(tmp_path))
    weight = 8 + header_len
    scale = weight + 508 * 64
    assert rank_byte_ranges(tensors, geometry, [1], 2) == [
        (weight + 240 * 64, weight + 508 * 64),
        (scale + 240 * 2, scale + 508 * 2),
    ]
    # Rank 1's weight rows end where the scale tensor starts, so with rank 0 added all is one.
    assert rank_byte_ranges(tensors, geometry, [0, 1], 2) == [(weight, scale + 508 * 2)]
    assert rank_byte_ranges(tensors, geometry, [2], 3) == []


def test_tensors_that_disagree_with_the_config_are_a_clear_error(tmp_path: Path) -> None:
    geometry = EngramGeometry.from_config(small_config())
    assert geometry is not None
    shard = tmp_path / "wrong.safetensors"
    write_safetensors(
        shard,
        {
            "layers.2.engram.embed.weight": ("F8_E4M3", [500, 64]),
            "layers.2.engram.embed.scale": ("F8_E8M0", [500, 2]),
        },
    )
    _, tensors, _ = read_safetensors_header(shard)
    with pytest.raises(EngramError, match=r"needs a 1-byte dtype of shape \[508, 64\]"):
        rank_byte_ranges(tensors, geometry, [0], 2)
    write_safetensors(shard, {"layers.2.engram.embed.weight": ("F8_E4M3", [508, 64])})
    _, tensors, _ = read_safetensors_header(shard)
    with pytest.raises(EngramError, match=r"not layers\.2\.engram\.embed\.scale"):
        rank_byte_ranges(tensors, geometry, [0], 2)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x01\x02", "too short"),
        (struct.pack("<Q", 10**6) + b"{}", "header length field says 1000000"),
        (struct.pack("<Q", 4) + b"{{{{", "is not JSON"),
        (
            struct.pack("<Q", 64)
            + json.dumps({"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 8]}})
            .encode()
            .ljust(64)
            + b"\0" * 8,
            "has data_offsets",
        ),
        (struct.pack("<Q", 16) + b'{"t": [1, 2, 3]}', "is not {dtype, shape"),
    ],
)
def test_broken_headers_are_clear_errors(tmp_path: Path, content: bytes, message: str) -> None:
    shard = tmp_path / "broken.safetensors"
    shard.write_bytes(content)
    with pytest.raises(EngramError, match=message):
        read_safetensors_header(shard)


def test_merge_ranges() -> None:
    assert merge_ranges([(10, 20), (0, 5), (5, 7), (15, 30), (40, 40)]) == [(0, 7), (10, 30)]


def test_module_runs_flat_beside_errors_with_the_standard_library(tmp_path: Path) -> None:
    """As the lab's engine image holds it: engram.py and errors.py copied flat, no package."""
    package = Path(__file__).parents[1] / "sparkdeploy"
    for source in (package / "node" / "engram.py", package / "errors.py"):
        shutil.copy(source, tmp_path / source.name)
    probe = (
        "import engram, errors, sys; "
        f"g = engram.EngramGeometry.from_config({{'text_config': {DSV41_TEXT_CONFIG!r}}}); "
        "print(g.rank_rows(0, 3, 4)); "
        "print('sparkdeploy' in sys.modules, engram.EngramError is errors.EngramError)"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert result.stdout.split("\n")[:2] == ["(288003654, 384006168)", "False True"]
