"""Engram table geometry, safetensors headers and the byte ranges of each tensor-parallel rank.

Standard library + sparkdeploy.errors, and importable beside a flat copy of errors.py: the
staging step ships both to the nodes over SSH (sparkdeploy.remote.node_script) and the lab's
engine image copies both next to the engine stand-in.

The rules (see docs/field.md, "Engram tables"): each Engram layer's table is made of
(max_ngram_size - 1) * n_heads hash columns, ordered by n-gram order then head, each of a prime
size; rank r of TP size tp owns columns [r*part, r*part+part) with part = ceil(columns / tp).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

try:
    from sparkdeploy.errors import EngramError
except ImportError:  # copied flat into the lab's engine image, beside errors.py
    from errors import EngramError  # type: ignore[no-redef, import-not-found]


HEADER_LENGTH_BYTES = 8
# A safetensors header larger than this is a corrupt length field, not a real header.
MAX_HEADER_BYTES = 100 * 1024 * 1024
SCALE_GROUP = 32  # one ue8m0 scale per 32 fp8 values of a row
INDEX_FILE = "model.safetensors.index.json"

CONFIG_KEYS = (
    "engram_layer_ids",
    "engram_num_embeddings",
    "engram_max_ngram_size",
    "engram_vocab_size",
    "engram_n_heads",
    "engram_head_dim",
)

DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}

# Bases that make Miller-Rabin exact below this bound (Sorenson & Webster, 2015).
_MILLER_RABIN_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
_MILLER_RABIN_EXACT_BELOW = 3_317_044_064_679_887_385_961_981


def is_prime(n: int) -> bool:
    """Deterministic primality test for n below 3.3e24 (far above any Engram vocabulary)."""
    if n >= _MILLER_RABIN_EXACT_BELOW:
        raise EngramError(
            f"is_prime({n}): above {_MILLER_RABIN_EXACT_BELOW}, where the fixed Miller-Rabin "
            "bases are no longer exact; an engram_vocab_size this large is not a real config"
        )
    if n < 2:
        return False
    for p in _MILLER_RABIN_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MILLER_RABIN_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@lru_cache(maxsize=64)
def prime_columns(
    layer_count: int, max_ngram_size: int, vocab_size: int, n_heads: int
) -> tuple[tuple[int, ...], ...]:
    """Per layer, the prime size of each hash column (docs/field.md's rule), before any check.

    For each layer in order and each n-gram order in it, a counter starts at vocab_size - 1;
    each head takes the next prime above the counter that no earlier column has taken.
    """
    taken: set[int] = set()
    layers: list[tuple[int, ...]] = []
    for _layer in range(layer_count):
        columns: list[int] = []
        for _order in range(2, max_ngram_size + 1):
            counter = vocab_size - 1
            for _head in range(n_heads):
                candidate = counter + 1
                while candidate in taken or not is_prime(candidate):
                    candidate += 1
                taken.add(candidate)
                columns.append(candidate)
                counter = candidate
        layers.append(tuple(columns))
    return tuple(layers)


@dataclass(frozen=True)
class EngramGeometry:
    """The shape of a model's Engram tables, as its config.json describes them."""

    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]
    max_ngram_size: int
    vocab_size: int
    n_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> EngramGeometry | None:
        """The geometry in a config.json dict (its `text_config`, else the top level).

        None when the config has no Engram tables; EngramError when it has some of the keys
        but not all, or values of the wrong kind.
        """
        text_config = config.get("text_config")
        for section_name, section in (("text_config", text_config), ("top level", config)):
            if not isinstance(section, Mapping):
                continue
            present = [key for key in CONFIG_KEYS if key in section]
            if not present:
                continue
            missing = [key for key in CONFIG_KEYS if key not in section]
            if missing:
                raise EngramError(
                    f"config.json {section_name}: has {', '.join(present)} but lacks "
                    f"{', '.join(missing)}; an Engram config needs all of {', '.join(CONFIG_KEYS)}"
                )
            return cls._from_section(section_name, section)
        return None

    @classmethod
    def _from_section(cls, section_name: str, section: Mapping[str, Any]) -> EngramGeometry:
        def int_list(key: str) -> tuple[int, ...]:
            value = section[key]
            if not isinstance(value, list) or not all(_is_int(v) for v in value):
                raise EngramError(
                    f"config.json {section_name}.{key}: expected a list of integers, got {value!r}"
                )
            return tuple(value)

        def positive_int(key: str) -> int:
            value = section[key]
            if not _is_int(value) or value < 1:
                raise EngramError(
                    f"config.json {section_name}.{key}: expected a positive integer, got {value!r}"
                )
            return int(value)

        geometry = cls(
            layer_ids=int_list("engram_layer_ids"),
            num_embeddings=int_list("engram_num_embeddings"),
            max_ngram_size=positive_int("engram_max_ngram_size"),
            vocab_size=positive_int("engram_vocab_size"),
            n_heads=positive_int("engram_n_heads"),
            head_dim=positive_int("engram_head_dim"),
        )
        if len(geometry.layer_ids) != len(geometry.num_embeddings):
            raise EngramError(
                f"config.json {section_name}: engram_layer_ids has {len(geometry.layer_ids)} "
                f"entries but engram_num_embeddings has {len(geometry.num_embeddings)}; "
                "they must pair up one table size per layer"
            )
        if geometry.max_ngram_size < 2:
            raise EngramError(
                f"config.json {section_name}.engram_max_ngram_size: {geometry.max_ngram_size} "
                "leaves no n-gram order (orders run from 2 to max_ngram_size); use 2 or more"
            )
        if geometry.head_dim % SCALE_GROUP:
            raise EngramError(
                f"config.json {section_name}.engram_head_dim: {geometry.head_dim} is not a "
                f"multiple of {SCALE_GROUP}, so the ue8m0 scale tensor has no whole width"
            )
        if len(set(geometry.layer_ids)) != len(geometry.layer_ids):
            raise EngramError(
                f"config.json {section_name}.engram_layer_ids: {list(geometry.layer_ids)} names "
                "a layer twice; each Engram layer has one table"
            )
        geometry.column_sizes()  # a config whose columns do not add up fails here, not later
        return geometry

    @property
    def columns_per_layer(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    def column_sizes(self) -> list[list[int]]:
        """Per layer, the prime size of each hash column, checked against num_embeddings."""
        layers = prime_columns(
            len(self.layer_ids), self.max_ngram_size, self.vocab_size, self.n_heads
        )
        for layer_id, expected, columns in zip(
            self.layer_ids, self.num_embeddings, layers, strict=True
        ):
            if sum(columns) != expected:
                raise EngramError(
                    f"Engram layer {layer_id}: its {len(columns)} prime columns (vocab "
                    f"{self.vocab_size}, {self.n_heads} heads, n-grams up to "
                    f"{self.max_ngram_size}) sum to {sum(columns)} rows, but "
                    f"engram_num_embeddings says {expected}; the config is inconsistent "
                    "(check engram_vocab_size, engram_n_heads, engram_max_ngram_size)"
                )
        return [list(columns) for columns in layers]

    def rank_rows(self, layer_pos: int, rank: int, tp: int) -> tuple[int, int]:
        """Rows [begin, end) of the layer at position layer_pos that TP rank `rank` owns."""
        if tp < 1 or not 0 <= rank < tp:
            raise EngramError(f"rank {rank} of tensor-parallel size {tp}: need 0 <= rank < tp")
        if not 0 <= layer_pos < len(self.layer_ids):
            raise EngramError(
                f"Engram layer position {layer_pos}: the config has {len(self.layer_ids)} "
                f"Engram layers ({list(self.layer_ids)})"
            )
        columns = self.column_sizes()[layer_pos]
        part = math.ceil(len(columns) / tp)
        first = min(rank * part, len(columns))
        last = min(first + part, len(columns))
        return sum(columns[:first]), sum(columns[:last])


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def weight_tensor_name(layer_id: int) -> str:
    return f"layers.{layer_id}.engram.embed.weight"


def scale_tensor_name(layer_id: int) -> str:
    return f"layers.{layer_id}.engram.embed.scale"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file; begin and end are absolute offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def row_width(self) -> int:
        """Bytes per row (per index of the first dimension)."""
        return math.prod(self.shape[1:]) * DTYPE_BYTES[self.dtype]


def safetensors_shards(snapshot: str | os.PathLike[str]) -> list[str]:
    """The safetensors files of a model dir: every *.safetensors and every file its index's
    weight_map names (whether present or not: a missing shard is the reader's error)."""
    found = sorted(
        os.path.join(snapshot, name)
        for name in os.listdir(snapshot)
        if name.endswith(".safetensors")
    )
    index = os.path.join(snapshot, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as index_file:
            weight_map = json.load(index_file).get("weight_map", {})
        found += sorted({os.path.join(snapshot, name) for name in weight_map.values()} - set(found))
    return found


def read_safetensors_header(
    path: str | os.PathLike[str],
) -> tuple[int, dict[str, TensorInfo], dict[str, str]]:
    """(header length H, tensors by name, __metadata__) of a safetensors file.

    Tensor data starts at 8 + H; each TensorInfo carries absolute offsets.
    """
    with open(path, "rb") as shard:
        file_size = os.fstat(shard.fileno()).st_size
        prefix = shard.read(HEADER_LENGTH_BYTES)
        if len(prefix) < HEADER_LENGTH_BYTES:
            raise EngramError(
                f"{path}: {file_size} bytes, too short for a safetensors header length; "
                "the file is truncated, fetch it again"
            )
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or HEADER_LENGTH_BYTES + header_len > file_size:
            raise EngramError(
                f"{path}: header length field says {header_len} bytes in a file of "
                f"{file_size}; not a safetensors file or truncated, fetch it again"
            )
        raw = shard.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngramError(
            f"{path}: the {header_len}-byte safetensors header is not JSON ({exc}); "
            "the file is corrupt, fetch it again"
        ) from exc
    if not isinstance(header, dict):
        raise EngramError(f"{path}: the safetensors header is not a JSON object")
    data_start = HEADER_LENGTH_BYTES + header_len
    metadata = header.pop("__metadata__", None) or {}
    tensors = {
        name: _tensor_info(path, name, entry, data_start, file_size)
        for name, entry in header.items()
    }
    return header_len, tensors, metadata


def _tensor_info(
    path: str | os.PathLike[str], name: str, entry: object, data_start: int, file_size: int
) -> TensorInfo:
    try:
        if not isinstance(entry, dict):
            raise TypeError(type(entry).__name__)
        dtype = entry["dtype"]
        shape = tuple(int(dim) for dim in entry["shape"])
        begin, end = (int(offset) for offset in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise EngramError(
            f"{path}: header entry {name!r} is not {{dtype, shape, data_offsets: [begin, end]}}: "
            f"{entry!r}"
        ) from exc
    if dtype not in DTYPE_BYTES:
        raise EngramError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    info = TensorInfo(name, dtype, shape, data_start + begin, data_start + end)
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if not 0 <= begin <= end or end - begin != expected or info.end > file_size:
        raise EngramError(
            f"{path}: tensor {name!r} ({dtype} {list(shape)}, {expected} bytes) has data_offsets "
            f"[{begin}, {end}] in a file of {file_size} bytes; the file is corrupt or truncated"
        )
    return info


def engram_tables(
    tensors: Mapping[str, TensorInfo], geometry: EngramGeometry
) -> list[tuple[int, TensorInfo, TensorInfo]]:
    """(layer position, weight, scale) of each Engram layer whose table is among `tensors`.

    Checks each table's shape against the geometry: a config that disagrees with its
    checkpoint would make every rank read the wrong rows.
    """
    tables = []
    for layer_pos, (layer_id, rows) in enumerate(
        zip(geometry.layer_ids, geometry.num_embeddings, strict=True)
    ):
        weight = tensors.get(weight_tensor_name(layer_id))
        scale = tensors.get(scale_tensor_name(layer_id))
        if weight is None and scale is None:
            continue
        expected = {
            weight_tensor_name(layer_id): (weight, (rows, geometry.head_dim)),
            scale_tensor_name(layer_id): (scale, (rows, geometry.head_dim // SCALE_GROUP)),
        }
        for name, (info, shape) in expected.items():
            if info is None:
                raise EngramError(
                    f"Engram layer {layer_id}: the shard has one tensor of the table but not "
                    f"{name}; both weight and scale must be in the same shard"
                )
            if info.shape != shape or DTYPE_BYTES[info.dtype] != 1:
                raise EngramError(
                    f"Engram tensor {name}: {info.dtype} {list(info.shape)} in the shard, but "
                    f"the config's geometry needs a 1-byte dtype of shape {list(shape)}; the "
                    "config.json and the checkpoint are of different models or revisions"
                )
        assert weight is not None
        assert scale is not None
        tables.append((layer_pos, weight, scale))
    return tables


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges with overlapping or touching ones joined; empty ranges dropped."""
    merged: list[tuple[int, int]] = []
    for begin, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((begin, end))
    return merged


def rank_byte_ranges(
    tensors: Mapping[str, TensorInfo],
    geometry: EngramGeometry,
    ranks: Sequence[int],
    tp: int,
) -> list[tuple[int, int]]:
    """Absolute byte ranges, sorted and merged, of the Engram rows that `ranks` own.

    Covers every Engram weight and scale tensor in `tensors` (one shard's header); the header
    itself is not included.
    """
    ranges = []
    for layer_pos, weight, scale in engram_tables(tensors, geometry):
        for rank in ranks:
            first_row, last_row = geometry.rank_rows(layer_pos, rank, tp)
            for info in (weight, scale):
                width = info.row_width
                ranges.append((info.begin + first_row * width, info.begin + last_row * width))
    return merge_ranges(ranges)
