"""Tiny HF-style model repos for the lab hub, with deterministic tensor content.

Every tensor's bytes are a pure function of (tensor name, byte offset in the tensor), so anyone
holding this file can tell whether bytes read from a checkpoint or a sparse copy are the ones
the generator wrote: the engine stand-in checks its rank's Engram rows with `row_bytes`.
The content helpers are standard library only (the engine image copies this file next to the
stand-in); `generate_repo` runs on the host.

Content scheme: per tensor, a pseudo-random pad of PAD_BYTES (no zero byte, so no row is ever
all zeros); the tensor's bytes are cut in blocks of BLOCK_BYTES and block k is the pad read from
a pseudo-random offset picked by (name, k). Generating is one memory copy per block, and any
range at the wrong offset, of another tensor or zeroed, differs from the expected bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

BLOCK_BYTES = 1 << 20
PAD_BYTES = BLOCK_BYTES + 4093  # not a multiple of the block, so offsets spread over the pad
SCALE_GROUP = 32
DENSE_ROW_BYTES = 1024  # BF16 rows of 512 values
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_NO_ZERO_BYTES = bytes([1]) + bytes(range(1, 256))
_SIZE_PATTERN = re.compile(r"(?i)^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$")


@lru_cache(maxsize=32)
def _pad(tensor_name: str) -> bytes:
    """The tensor's pad, followed by its own first block so any block is one slice."""
    pad = hashlib.shake_128(b"lab.tinymodel\0" + tensor_name.encode()).digest(PAD_BYTES)
    pad = pad.translate(_NO_ZERO_BYTES)
    return pad + pad[:BLOCK_BYTES]


def _block_start(tensor_name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{tensor_name}\0{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % PAD_BYTES


def _block(tensor_name: str, block: int) -> bytes:
    start = _block_start(tensor_name, block)
    return _pad(tensor_name)[start : start + BLOCK_BYTES]


def iter_tensor_bytes(tensor_name: str, start: int, stop: int) -> Iterator[bytes]:
    """The content of bytes [start, stop) of a tensor, in chunks of at most BLOCK_BYTES."""
    if not 0 <= start <= stop:
        raise ValueError(f"byte range [{start}, {stop}) of {tensor_name}: need 0 <= start <= stop")
    position = start
    while position < stop:
        block, within = divmod(position, BLOCK_BYTES)
        take = min(BLOCK_BYTES - within, stop - position)
        if within == 0 and take == BLOCK_BYTES:
            yield _block(tensor_name, block)
        else:
            begin = _block_start(tensor_name, block) + within
            yield _pad(tensor_name)[begin : begin + take]
        position += take


def tensor_bytes(tensor_name: str, start: int, stop: int) -> bytes:
    """Bytes [start, stop) of a tensor's content (offsets from the tensor's first byte)."""
    return b"".join(iter_tensor_bytes(tensor_name, start, stop))


def row_bytes(tensor_name: str, row: int, width: int) -> bytes:
    """The content of one row of `width` bytes of a generated tensor."""
    return tensor_bytes(tensor_name, row * width, (row + 1) * width)


class Digest(Protocol):
    def update(self, data: bytes, /) -> None: ...


def write_tensor_bytes(
    fd: int,
    data_begin: int,
    tensor_name: str,
    start: int,
    stop: int,
    digest: Digest | None = None,
) -> None:
    """Write bytes [start, stop) of a tensor whose data starts at file offset data_begin.

    For a row range [a, b) of width w: start = a * w, stop = b * w. The bytes written are also
    fed to `digest` when one is given.
    """
    position = data_begin + start
    for chunk in iter_tensor_bytes(tensor_name, start, stop):
        _pwrite_all(fd, chunk, position)
        if digest is not None:
            digest.update(chunk)
        position += len(chunk)


def _pwrite_all(fd: int, data: bytes, position: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        position += written
        view = view[written:]


def first_mismatch(fd: int, data_begin: int, tensor_name: str, start: int, stop: int) -> int | None:
    """The first byte offset in [start, stop) where the file differs from the content, or None.

    A short read (the file ends early) counts as a mismatch at the first missing byte.
    """
    position = start
    for expected in iter_tensor_bytes(tensor_name, start, stop):
        found = os.pread(fd, len(expected), data_begin + position)
        if found != expected:
            for index, (a, b) in enumerate(zip(found, expected, strict=False)):
                if a != b:
                    return position + index
            return position + len(found)
        position += len(expected)
    return None


# --- repo generation (host side) -----------------------------------------------------------


@dataclass(frozen=True)
class EngramSpec:
    """A scaled-down Engram config: docs/field.md's column and TP rules with a small vocabulary."""

    layer_ids: tuple[int, ...] = (1, 3)
    vocab_size: int = 1000
    n_heads: int = 2
    max_ngram_size: int = 3
    head_dim: int = 64

    @property
    def row_bytes(self) -> int:
        """Bytes per table row over both tensors (fp8 weight and ue8m0 scale)."""
        return self.head_dim + self.head_dim // SCALE_GROUP

    @classmethod
    def for_table_bytes(cls, table_bytes: int, **fields: Any) -> EngramSpec:
        """A spec whose tables are each about table_bytes (the vocabulary sets the size)."""
        probe = cls(**fields)
        columns = (probe.max_ngram_size - 1) * probe.n_heads
        vocab_size = max(2, table_bytes // (probe.row_bytes * columns))
        return cls(**{**fields, "vocab_size": vocab_size})

    def config_keys(self) -> dict[str, Any]:
        """The engram_* keys of config.json, num_embeddings from the prime column rule."""
        # Host side only: the engine image carries this module without the sparkdeploy package.
        from sparkdeploy.node.engram import prime_columns

        columns = prime_columns(
            len(self.layer_ids), self.max_ngram_size, self.vocab_size, self.n_heads
        )
        return {
            "engram_layer_ids": list(self.layer_ids),
            "engram_num_embeddings": [sum(layer) for layer in columns],
            "engram_max_ngram_size": self.max_ngram_size,
            "engram_vocab_size": self.vocab_size,
            "engram_n_heads": self.n_heads,
            "engram_head_dim": self.head_dim,
        }


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (2 if self.dtype == "BF16" else 1)


@dataclass(frozen=True)
class GeneratedRepo:
    """What generate_repo wrote: the repo directory and its files (paths relative to it)."""

    path: Path
    repo_id: str
    files: tuple[str, ...]
    shards: tuple[str, ...]
    engram_shards: dict[int, str] = field(default_factory=dict)  # layer id -> shard file
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum((self.path / name).stat().st_size for name in self.files)


def generate_repo(
    repos_dir: str | os.PathLike[str],
    repo_id: str,
    *,
    revision: str = "1",
    num_shards: int = 2,
    total_bytes: int = 256 * 1024,
    engram: EngramSpec | None = None,
    tp_size: int | None = None,
    gated_tokens: Sequence[str] = (),
    dense_holes: bool = False,
    context_length: int = 4096,
) -> GeneratedRepo:
    """Write an HF-style repo at repos_dir/<org>/<name>/ for the lab hub, replacing any old one.

    total_bytes is the size of the dense weights, split over num_shards shards; each Engram
    layer's table (weight and scale) goes in a shard of its own after them, as in DSV4.1.
    `revision` is recorded in config.json and the shard metadata, so two revisions of a repo
    differ in content (and in the hub's commit sha). With tp_size, the Engram columns must give
    every rank some rows. gated_tokens make the repo gated: the hub answers 401/403 unless
    one of them is sent. dense_holes leaves the dense weights as holes (zeros): instant to write
    for download benchmarks of many GiB; Engram tables always get their real content.
    context_length is the config's max_position_embeddings (and the tokenizer's limit).
    """
    if num_shards < 1 or total_bytes < 0:
        raise ValueError(f"{repo_id}: need num_shards >= 1 and total_bytes >= 0")
    if engram is not None and tp_size is not None:
        _check_every_rank_has_rows(engram, tp_size)
    final, staging = repo_staging(repos_dir, repo_id)
    org_dir, name = final.parent, final.name

    dense = _dense_shards(num_shards, total_bytes)
    tables = [] if engram is None else _engram_shards(engram)
    shard_count = len(dense) + len(tables)
    shard_names = [
        f"model-{index:05d}-of-{shard_count:05d}.safetensors" for index in range(1, shard_count + 1)
    ]
    weight_map: dict[str, str] = {}
    metadata = {"format": "pt", "lab_revision": revision}
    shard_sha256 = {}
    for index, (shard_name, tensors) in enumerate(zip(shard_names, [*dense, *tables], strict=True)):
        with_content = not (dense_holes and index < len(dense))
        shard_sha256[shard_name] = _write_shard(
            staging / shard_name, tensors, metadata, with_content=with_content
        )
        weight_map.update({tensor.name: shard_name for tensor in tensors})
    engram_shards = (
        {}
        if engram is None
        else dict(zip(engram.layer_ids, shard_names[len(dense) :], strict=True))
    )

    config = _config(num_shards, revision, engram, context_length)
    small_files: dict[str, Any] = {
        "config.json": config,
        "generation_config.json": {
            "bos_token_id": 0,
            "eos_token_id": 1,
            "temperature": 0.6,
            "top_p": 0.95,
        },
        "tokenizer.json": _tokenizer(),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "model_max_length": context_length,
            "chat_template": CHAT_TEMPLATE,
        },
        "model.safetensors.index.json": {
            "metadata": {"total_size": sum(t.nbytes for s in [*dense, *tables] for t in s)},
            "weight_map": dict(sorted(weight_map.items())),
        },
    }
    for file_name, content in small_files.items():
        (staging / file_name).write_text(json.dumps(content, indent=2) + "\n")
    (staging / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")

    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    gate = org_dir / f"{name}.gated"
    if gated_tokens:
        gate.write_text("".join(f"{token}\n" for token in gated_tokens))
    else:
        gate.unlink(missing_ok=True)
    # Host side only, like EngramSpec.config_keys: hand the hub the digests computed while
    # writing, so it never re-reads GiB of shards to answer its first request.
    from lab.hub.index import index_repo

    index_repo(repos_dir, repo_id, known_sha256=shard_sha256)
    files = tuple(sorted([*small_files, ".gitattributes", *shard_names]))
    return GeneratedRepo(final, repo_id, files, tuple(shard_names), engram_shards, config)


def repo_staging(repos_dir: str | os.PathLike[str], repo_id: str) -> tuple[Path, Path]:
    """(final, staging): the repo's dir under repos_dir and an empty dir beside it to write the
    new copy in, renamed over the final one when complete (the hub never serves half a repo)."""
    org, name = _split_repo_id(repo_id)
    org_dir = Path(repos_dir) / org
    org_dir.mkdir(parents=True, exist_ok=True)
    staging = org_dir / f".{name}.writing-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return org_dir / name, staging


def _split_repo_id(repo_id: str) -> tuple[str, str]:
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", p) for p in parts):
        raise ValueError(f"repo id {repo_id!r}: expected org/name of letters, digits, . _ -")
    return parts[0], parts[1]


def _check_every_rank_has_rows(engram: EngramSpec, tp_size: int) -> None:
    columns = (engram.max_ngram_size - 1) * engram.n_heads
    part = math.ceil(columns / tp_size)
    if part * (tp_size - 1) >= columns:
        raise ValueError(
            f"Engram spec with {columns} columns per layer at TP {tp_size}: columns are split "
            f"{part} per rank, so the last rank owns no rows; choose n_heads so that "
            f"(max_ngram_size - 1) * n_heads is a multiple of {tp_size}"
        )


def _dense_shards(num_shards: int, total_bytes: int) -> list[list[TensorSpec]]:
    shards = []
    rows_total = max(2 * num_shards, total_bytes // DENSE_ROW_BYTES)
    for index in range(num_shards):
        rows = rows_total // num_shards + (1 if index < rows_total % num_shards else 0)
        up = rows // 2
        shards.append(
            [
                TensorSpec(f"model.layers.{index}.mlp.up_proj.weight", "BF16", (up, 512)),
                TensorSpec(f"model.layers.{index}.mlp.down_proj.weight", "BF16", (rows - up, 512)),
            ]
        )
    return shards


def _engram_shards(engram: EngramSpec) -> list[list[TensorSpec]]:
    rows_per_layer = engram.config_keys()["engram_num_embeddings"]
    return [
        [
            TensorSpec(
                f"layers.{layer_id}.engram.embed.weight", "F8_E4M3", (rows, engram.head_dim)
            ),
            TensorSpec(
                f"layers.{layer_id}.engram.embed.scale",
                "F8_E8M0",
                (rows, engram.head_dim // SCALE_GROUP),
            ),
        ]
        for layer_id, rows in zip(engram.layer_ids, rows_per_layer, strict=True)
    ]


def _write_shard(
    path: Path, tensors: Sequence[TensorSpec], metadata: dict[str, str], *, with_content: bool
) -> str:
    """Write the shard; returns its sha256, computed on the way (tensors are packed in order)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for tensor in tensors:
        end = offset + tensor.nbytes
        header[tensor.name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header with spaces to 8 bytes
    data_start = 8 + len(raw)
    head = struct.pack("<Q", len(raw)) + raw
    digest = hashlib.sha256(head)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, data_start + offset)
        os.pwrite(fd, head, 0)
        if with_content:
            for tensor in tensors:
                begin = data_start + header[tensor.name]["data_offsets"][0]
                write_tensor_bytes(fd, begin, tensor.name, 0, tensor.nbytes, digest)
        else:
            zeros = bytes(BLOCK_BYTES)
            for start in range(0, offset, BLOCK_BYTES):
                digest.update(zeros[: min(BLOCK_BYTES, offset - start)])
    finally:
        os.close(fd)
    return digest.hexdigest()


def _config(
    num_shards: int, revision: str, engram: EngramSpec | None, context_length: int
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["TinyLabForCausalLM"],
        "model_type": "tiny_lab",
        "hidden_size": 512,
        "num_hidden_layers": num_shards,
        "num_attention_heads": 8,
        "vocab_size": len(_VOCABULARY),
        "max_position_embeddings": context_length,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "lab_revision": revision,
    }
    if engram is not None:
        config["text_config"] = {"model_type": "tiny_lab_text", **engram.config_keys()}
    return config


_VOCABULARY = ["<s>", "</s>", "<unk>", *(f"w{index}" for index in range(61))]


def _tokenizer() -> dict[str, Any]:
    return {
        "version": "1.0",
        "added_tokens": [
            {"id": index, "content": token, "special": True}
            for index, token in enumerate(_VOCABULARY[:3])
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "model": {
            "type": "WordLevel",
            "vocab": {token: index for index, token in enumerate(_VOCABULARY)},
            "unk_token": "<unk>",
        },
    }


def parse_size(text: str) -> int:
    """Bytes in a size like 4096, 512K, 1.5GiB, 2G (binary multiples)."""
    match = _SIZE_PATTERN.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4096, 512K, 1GiB")
    number, unit, _ = match.groups()
    return int(float(number) * 1024 ** "_KMGT".index(unit.upper() or "_"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.tinymodel", description="Write a tiny HF-style repo for the lab hub."
    )
    parser.add_argument("repos_dir", type=Path)
    parser.add_argument("repo_id")
    parser.add_argument("--size", type=parse_size, default=256 * 1024, help="dense weights")
    parser.add_argument("--shards", type=int, default=2, help="dense weight shards")
    parser.add_argument("--revision", default="1")
    parser.add_argument("--engram", action="store_true", help="add Engram tables")
    parser.add_argument("--engram-table-size", type=parse_size, help="bytes per Engram table")
    parser.add_argument("--engram-heads", type=int, default=EngramSpec.n_heads)
    parser.add_argument("--tp", type=int, help="check every rank of this TP size owns rows")
    parser.add_argument("--gated-token", action="append", default=[], help="make it gated")
    parser.add_argument("--dense-holes", action="store_true", help="dense weights as holes")
    args = parser.parse_args(argv)
    engram = None
    if args.engram or args.engram_table_size:
        engram = (
            EngramSpec.for_table_bytes(args.engram_table_size, n_heads=args.engram_heads)
            if args.engram_table_size
            else EngramSpec(n_heads=args.engram_heads)
        )
    started = time.monotonic()
    repo = generate_repo(
        args.repos_dir,
        args.repo_id,
        revision=args.revision,
        num_shards=args.shards,
        total_bytes=args.size,
        engram=engram,
        tp_size=args.tp,
        gated_tokens=args.gated_token,
        dense_holes=args.dense_holes,
    )
    elapsed = time.monotonic() - started
    summary = {
        "path": str(repo.path),
        "files": list(repo.files),
        "engram_shards": repo.engram_shards,
        "bytes": repo.total_bytes,
        "seconds": round(elapsed, 3),
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
