"""The model as the stand-in loads it: resolved offline from the HF cache, config.json and every
safetensors header read, this node's Engram rows checked against the lab generator's content,
and the memory figures vLLM would print derived from the sizes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    from lab.engine.standin_log import EngineFatal
except ImportError:  # copied flat into the engine image
    from standin_log import EngineFatal  # type: ignore[no-redef, import-not-found]

try:
    from sparkdeploy.errors import EngramError
    from sparkdeploy.node import engram
    from sparkdeploy.vllm import kv_cache
except ImportError:
    import engram  # type: ignore[no-redef, import-not-found]
    import kv_cache  # type: ignore[no-redef, import-not-found]
    from errors import EngramError  # type: ignore[no-redef, import-not-found]

try:
    from lab import tinymodel
except ImportError:
    try:
        import tinymodel  # type: ignore[no-redef, import-not-found]
    except ImportError:
        # Without the generator's content rules only holes (all-zero rows) can be detected.
        tinymodel = None  # type: ignore[assignment]

GIB = 1 << 30
OFFLINE_MISS = (
    "huggingface_hub.errors.LocalEntryNotFoundError: Cannot find an appropriate cached snapshot "
    "folder for the specified revision on the local disk and outgoing traffic has been "
    "disabled. To enable repo look-ups and downloads online, pass 'local_files_only=False' as "
    "input."
)
# Rows checked per rank range besides both ends: enough to catch a partial copy, cheap on GiB.
MIDDLE_SAMPLES = 6


@dataclass(frozen=True)
class Shard:
    path: Path
    tensors: Mapping[str, engram.TensorInfo]


@dataclass(frozen=True)
class LoadedModel:
    """What the stand-in knows about the model after reading the snapshot."""

    model: str
    snapshot: Path
    config: Mapping[str, Any]
    shards: Sequence[Shard]
    geometry: engram.EngramGeometry | None

    def config_value(self, key: str, default: int) -> int:
        """An integer of the language model's config: its text_config first, then the top."""
        nested = self.config.get("text_config")
        for section in (nested if isinstance(nested, Mapping) else {}, self.config):
            if key in section:
                return int(section[key])
        return default

    def engram_tensor_names(self) -> set[str]:
        if self.geometry is None:
            return set()
        return {
            name
            for layer_id in self.geometry.layer_ids
            for name in (engram.weight_tensor_name(layer_id), engram.scale_tensor_name(layer_id))
        }

    def dense_bytes(self) -> int:
        """Bytes of every tensor but the Engram tables (which vLLM's disk mode leaves on disk)."""
        skip = self.engram_tensor_names()
        return sum(
            info.end - info.begin
            for shard in self.shards
            for name, info in shard.tensors.items()
            if name not in skip
        )


def hub_cache_dir(env: Mapping[str, str]) -> Path:
    """The HF cache huggingface_hub would use: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]) / "hub"
    return Path(env.get("HOME", "/root")) / ".cache" / "huggingface" / "hub"


def resolve_snapshot(model: str, revision: str | None, env: Mapping[str, str]) -> Path:
    """The snapshot directory of `model` (a repo id or a local directory), offline."""
    local = Path(model)
    if local.is_absolute() or model.startswith("."):
        if (local / "config.json").is_file():
            return local
        raise EngineFatal([f"ValueError: Invalid repository ID or local directory: {model!r}"])
    cache = hub_cache_dir(env)
    repo_dir = cache / ("models--" + model.replace("/", "--"))
    wanted = revision or "main"
    ref_file = repo_dir / "refs" / wanted
    if ref_file.is_file():
        commit = ref_file.read_text().strip()
    elif re.fullmatch(r"[0-9a-f]{40}", wanted):
        commit = wanted
    else:
        raise EngineFatal(
            [
                f"no refs/{wanted} for {model} in the HF cache {cache} (looked for {ref_file})",
                OFFLINE_MISS,
            ]
        )
    snapshot = repo_dir / "snapshots" / commit
    if not snapshot.is_dir():
        raise EngineFatal(
            [
                f"refs/{wanted} of {model} names snapshot {commit}, which is not in {repo_dir}",
                OFFLINE_MISS,
            ]
        )
    return snapshot


def load_model(model: str, revision: str | None, env: Mapping[str, str]) -> LoadedModel:
    """Resolve the snapshot, read config.json and the header of every safetensors shard."""
    snapshot = resolve_snapshot(model, revision, env)
    config_path = snapshot / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError as exc:
        raise EngineFatal(
            [f"OSError: {model} does not appear to have a file named config.json ({config_path})"]
        ) from exc
    except json.JSONDecodeError as exc:
        raise EngineFatal([f"OSError: {config_path} is not valid JSON: {exc}"]) from exc
    try:
        geometry = engram.EngramGeometry.from_config(config)
    except EngramError as exc:
        raise EngineFatal([f"ValueError: {exc}"]) from exc
    shard_paths = _shard_paths(model, snapshot)
    shards = []
    for path in shard_paths:
        try:
            _, tensors, _ = engram.read_safetensors_header(path)
        except FileNotFoundError as exc:
            raise EngineFatal(
                [f"FileNotFoundError: [Errno 2] No such file or directory: '{path}'"]
            ) from exc
        except EngramError as exc:
            raise EngineFatal(
                [f"safetensors_rust.SafetensorError: Error while deserializing header: {exc}"]
            ) from exc
        shards.append(Shard(path, tensors))
    return LoadedModel(model, snapshot, config, shards, geometry)


def _shard_paths(model: str, snapshot: Path) -> list[Path]:
    found = [Path(path) for path in engram.safetensors_shards(snapshot)]
    if not found:
        raise EngineFatal([f"RuntimeError: Cannot find any model weights with `{model}`"])
    return found


def verify_engram_rows(model: LoadedModel, ranks: Sequence[int], tp: int) -> list[str]:
    """Check that the shards hold each of `ranks`' Engram rows; returns what was checked.

    Rows are sampled at both ends of each rank's range and evenly inside it; rows outside the
    range are never read (a per-rank sparse copy has holes there). A hole, a missing table or
    content that differs from the generator's is an EngineFatal naming tensor, rows and file.
    """
    geometry = model.geometry
    if geometry is None:
        return []
    found: dict[int, tuple[Shard, engram.TensorInfo, engram.TensorInfo]] = {}
    for shard in model.shards:
        try:
            tables = engram.engram_tables(shard.tensors, geometry)
        except EngramError as exc:
            raise EngineFatal([f"ValueError: {shard.path}: {exc}"]) from exc
        for layer_pos, weight, scale in tables:
            found[layer_pos] = (shard, weight, scale)
    checked = []
    for layer_pos, layer_id in enumerate(geometry.layer_ids):
        if layer_pos not in found:
            raise EngineFatal(
                [
                    f"RuntimeError: Engram layer {layer_id}: no shard of {model.snapshot} holds "
                    f"{engram.weight_tensor_name(layer_id)}; the checkpoint is incomplete"
                ]
            )
        shard, weight, scale = found[layer_pos]
        with open(shard.path, "rb") as handle:
            for rank in ranks:
                first, last = geometry.rank_rows(layer_pos, rank, tp)
                for info in (weight, scale):
                    _check_rows(handle.fileno(), shard.path, info, first, last, rank, tp)
                checked.append(
                    f"layer {layer_id} rows [{first}, {last}) of TP rank {rank}/{tp} "
                    f"({shard.path.name})"
                )
    return checked


def _sample_rows(first: int, last: int) -> list[int]:
    if last <= first:
        return []
    step = max(1, (last - first) // (MIDDLE_SAMPLES + 1))
    rows = {first, first + 1, last - 2, last - 1}
    rows.update(range(first + step, last - 1, step))
    return sorted(row for row in rows if first <= row < last)


def _check_rows(
    fd: int, path: Path, info: engram.TensorInfo, first: int, last: int, rank: int, tp: int
) -> None:
    width = info.row_width
    for row in _sample_rows(first, last):
        data = os.pread(fd, width, info.begin + row * width)
        where = f"Engram tensor {info.name} rows [{first}, {last}) of TP rank {rank}/{tp} in {path}"
        if len(data) < width or not any(data):
            raise EngineFatal(
                [
                    f"RuntimeError: {where}: row {row} is all zeros; this rank's rows are not in "
                    "the file (a sparse copy made for another rank, or a copy never written)"
                ]
            )
        if tinymodel is not None and data != tinymodel.row_bytes(info.name, row, width):
            raise EngineFatal(
                [
                    f"RuntimeError: {where}: row {row} differs from the checkpoint's content "
                    "(another rank's rows, or rows written at the wrong offset)"
                ]
            )


@dataclass(frozen=True)
class DeviceMemory:
    """The emulated GB10: total and free unified memory in GiB (STANDIN_GPU_*_GIB override)."""

    total_gib: float
    free_gib: float

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DeviceMemory:
        return cls(
            total_gib=float(env.get("STANDIN_GPU_TOTAL_GIB", "121.63")),
            free_gib=float(env.get("STANDIN_GPU_FREE_GIB", "118.0")),
        )

    def check_utilization(self, utilization: float) -> None:
        wanted = utilization * self.total_gib
        if wanted > self.free_gib:
            raise EngineFatal([free_memory_line(self, utilization)])


def free_memory_line(memory: DeviceMemory, utilization: float) -> str:
    return (
        f"ValueError: Free memory on device cuda:0 ({memory.free_gib:.2f}/"
        f"{memory.total_gib:.2f} GiB) on startup is less than desired GPU memory utilization "
        f"({utilization}, {utilization * memory.total_gib:.2f} GiB). Decrease GPU memory "
        "utilization or reduce GPU memory used by other processes."
    )


# Peak activation memory the profile run would find, on top of the weights.
ACTIVATION_PEAK_GIB = 1.5


@dataclass(frozen=True)
class KvCachePlan:
    weights_gib: float
    available_gib: float
    tokens: int
    max_model_len: int

    @property
    def concurrency(self) -> float:
        return self.tokens / self.max_model_len


def kv_bytes_per_token(model: LoadedModel, tp: int, kv_cache_dtype: str | None) -> int:
    """One token's KV cache on one rank, by vLLM's page-size rule (sparkdeploy.vllm.kv_cache)."""
    try:
        geometry = kv_cache.KvGeometry.from_config(model.config)
        element = kv_cache.model_dtype_bytes(model.config)
        return geometry.token_bytes(geometry.layers, tp, kv_cache_dtype or "auto", element)
    except kv_cache.KvCacheError as exc:
        raise EngineFatal([f"ValueError: {exc}"]) from exc


def plan_kv_cache(
    model: LoadedModel,
    memory: DeviceMemory,
    *,
    tp: int,
    utilization: float,
    kv_cache_memory_bytes: int | None,
    max_model_len: int | None,
    block_size: int,
    kv_cache_dtype: str | None,
) -> KvCachePlan:
    """The figures of vLLM's KV cache lines; EngineFatal where vLLM would refuse to start."""
    weights_gib = model.dense_bytes() / tp / GIB
    if kv_cache_memory_bytes is not None:
        available_gib = kv_cache_memory_bytes / GIB
    else:
        available_gib = utilization * memory.total_gib - weights_gib - ACTIVATION_PEAK_GIB
    if available_gib <= 0:
        raise EngineFatal(
            [
                "ValueError: No available memory for the cache blocks. Try increasing "
                "`gpu_memory_utilization` when initializing the engine."
            ]
        )
    per_token = kv_bytes_per_token(model, tp, kv_cache_dtype)
    blocks = int(available_gib * GIB) // (per_token * block_size)
    tokens = blocks * block_size
    length = max_model_len or model.config_value("max_position_embeddings", 4096)
    if length > tokens:
        needed_gib = length * per_token / GIB
        raise EngineFatal(
            [
                f"ValueError: To serve at least one request with the model's max seq len "
                f"({length}), ({needed_gib:.2f} GiB KV cache is needed, which is larger than the "
                f"available KV cache memory ({available_gib:.2f} GiB). Based on the available "
                f"memory, the estimated maximum model length is {tokens}. Try increasing "
                "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the "
                "engine."
            ]
        )
    return KvCachePlan(weights_gib, available_gib, tokens, length)
