"""The fit check: do the model, its KV cache and the engine fit each node's memory?

Run before anything is put on a node (the deploy's fit step, `sparkdeploy plan`), from what the
NAS cache holds: config.json and the safetensors headers of the model (never the tensors), the
recipe's memory flags and the inventory's node memory (sparkdeploy.spec.memory). Per node:

- weights: every tensor's bytes, a layer's on the pipeline stage that runs it (vLLM's
  get_pp_indices), split over the tensor-parallel ranks when it has two or more dimensions (a
  1-D norm or bias is replicated); the Engram tables left out when the recipe keeps them on disk;
- KV cache: what one request of max-model-len needs (vLLM refuses to start without it:
  `vllm/v1/core/kv_cache_utils.py`, check_enough_kv_cache_memory) and what the cache gets: the
  budget left after weights and the engine's overhead, or the pinned size;
- the budget: gpu-memory-utilization x the node's memory, or all of it when the KV cache is pinned
  (vLLM then ignores the utilization: `vllm/config/cache.py`, kv_cache_memory_bytes).

docs/field.md#memory-fit gives the sources and what the estimate leaves out.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sparkdeploy.errors import EngramError, FitError
from sparkdeploy.node import engram
from sparkdeploy.node.hfcache import SnapshotNotFound, resolve_snapshot
from sparkdeploy.spec.memory import TIGHT_MARGIN, FitReport, NodeFit, Verdict
from sparkdeploy.spec.plan import NodePlan, Plan
from sparkdeploy.units import human_bytes
from sparkdeploy.vllm.kv_cache import KvCacheError, KvGeometry, config_value, model_dtype_bytes

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FLOAT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
_SKIP_FIT = 'deploy with skip=["fit"] if you know it fits'


@dataclass(frozen=True)
class ModelFiles:
    """What the fit check reads of a model in the NAS cache: config.json and tensor headers."""

    repo: str
    snapshot: str
    config: dict[str, Any]
    tensors: tuple[engram.TensorInfo, ...]

    @property
    def engram_tensor_names(self) -> frozenset[str]:
        geometry = engram.EngramGeometry.from_config(self.config)
        if geometry is None:
            return frozenset()
        return frozenset(
            name
            for layer in geometry.layer_ids
            for name in (engram.weight_tensor_name(layer), engram.scale_tensor_name(layer))
        )


def read_model(hf_cache: str, repo: str, revision: str | None) -> ModelFiles:
    """config.json and every shard's header of repo@revision in the NAS cache at hf_cache."""
    try:
        _, snapshot = resolve_snapshot(hf_cache, repo, revision)
        with open(os.path.join(snapshot, "config.json")) as config_file:
            config = json.load(config_file)
        shards = engram.safetensors_shards(snapshot)
        tensors = tuple(
            info for shard in shards for info in engram.read_safetensors_header(shard)[1].values()
        )
    except SnapshotNotFound as exc:
        raise FitError(f"fit check: {exc}") from None
    except (OSError, ValueError, EngramError) as exc:
        raise FitError(
            f"fit check: cannot read {repo}'s config.json or safetensors headers in {hf_cache}: "
            f"{exc}; run the prefetch step again"
        ) from None
    if not isinstance(config, dict) or not tensors:
        raise FitError(
            f"fit check: {repo} in {snapshot} has no config object or no safetensors weights; "
            f"the fit check sizes safetensors checkpoints only ({_SKIP_FIT})"
        )
    return ModelFiles(repo, snapshot, config, tensors)


def pp_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """Each pipeline stage's layers: even parts, the remainder on all stages but the last
    (vllm-project/vllm `vllm/distributed/utils.py`, get_pp_indices)."""
    parts = [num_layers // pp] * pp
    for index in range(2, num_layers % pp + 2):
        parts[-index] += 1
    starts = [sum(parts[:stage]) for stage in range(pp)]
    return [range(start, start + part) for start, part in zip(starts, parts, strict=True)]


def _stage_of(name: str, num_layers: int, pp: int, ranges: Sequence[range]) -> int:
    """The pipeline stage that loads a tensor: its layer's; the embedding the first stage's,
    everything else outside the layers (final norm, LM head, MTP layers) the last stage's."""
    match = _LAYER.search(name)
    if match and int(match.group(1)) < num_layers:
        layer = int(match.group(1))
        return next(stage for stage, layers in enumerate(ranges) if layer in layers)
    return 0 if match is None and "embed" in name else pp - 1


def rank_weight_bytes(
    model: ModelFiles, *, tp: int, pp: int, rank: int, dtype: str, engram_on_disk: bool
) -> tuple[int, int]:
    """(bytes rank `rank` loads, Engram bytes it leaves on disk)."""
    num_layers = int(config_value(model.config, "num_hidden_layers") or 1)
    ranges = pp_layer_ranges(num_layers, pp)
    stage = rank // tp
    # Float tensors are loaded in the engine's dtype (a float32 checkpoint in 16 bits, unless
    # --dtype float32); quantized ones as stored.
    element = model_dtype_bytes(model.config, dtype)
    engram_names = model.engram_tensor_names
    loaded = on_disk = 0
    for info in model.tensors:
        size = info.end - info.begin
        if info.dtype in _FLOAT_DTYPES:
            size = size // _FLOAT_DTYPES[info.dtype] * element
        share = math.ceil(size / tp) if len(info.shape) > 1 else size
        if engram_on_disk and info.name in engram_names:
            on_disk += share
        elif _stage_of(info.name, num_layers, pp, ranges) == stage:
            loaded += share
    return loaded, on_disk


@dataclass(frozen=True)
class _RankNeeds:
    weights: int
    on_disk: int
    token_bytes: int  # KV cache of one token on this rank


def _rank_needs(plan: Plan, models: Sequence[ModelFiles], rank: int) -> _RankNeeds:
    memory = plan.memory
    tp, pp = memory.tensor_parallel_size, memory.pipeline_parallel_size
    flags = memory.flags
    weights = on_disk = token_bytes = 0
    for index, model in enumerate(models):
        drafter = index > 0  # a drafter runs beside every rank, without pipeline stages
        loaded, skipped = rank_weight_bytes(
            model,
            tp=tp,
            pp=1 if drafter else pp,
            rank=rank % tp if drafter else rank,
            dtype=flags.dtype,
            engram_on_disk=flags.engram_on_disk,
        )
        weights += loaded
        on_disk += skipped
        geometry = KvGeometry.from_config(model.config)
        if drafter:
            layers = geometry.layers
        else:
            layers = len(pp_layer_ranges(geometry.layers, pp)[rank // tp])
        token_bytes += geometry.token_bytes(
            layers, tp, flags.kv_cache_dtype, model_dtype_bytes(model.config, flags.dtype)
        )
    return _RankNeeds(weights, on_disk, token_bytes)


def node_ranks(plan: Plan, node: NodePlan) -> list[int]:
    """The global ranks (pp stage x tp + tp rank) a node runs."""
    per_node = plan.memory.tensor_parallel_size * plan.memory.pipeline_parallel_size
    per_node //= len(plan.nodes)
    return list(range(node.rank * per_node, (node.rank + 1) * per_node))


def estimate(plan: Plan, models: Sequence[ModelFiles]) -> FitReport:
    """The fit of `models` (the model, then any drafter) on the plan's nodes."""
    flags = plan.memory.flags
    try:
        max_model_len = flags.max_model_len or int(
            config_value(models[0].config, "max_position_embeddings") or 0
        )
        if max_model_len < 1:
            raise KvCacheError("config.json has no max_position_embeddings")
        needs = {
            rank: _rank_needs(plan, models, rank)
            for node in plan.nodes
            for rank in node_ranks(plan, node)
        }
    except KvCacheError as exc:
        raise FitError(
            f"fit check: {models[0].repo}: {exc}; the KV cache cannot be sized ({_SKIP_FIT})"
        ) from None
    block = flags.block_size
    # Each rank keeps max_model_len / dcp tokens of a request (FullAttentionSpec).
    request_tokens = math.ceil(max_model_len / flags.decode_context_parallel_size / block) * block
    fits = [_node_fit(plan, node, needs, request_tokens) for node in plan.nodes]
    on_disk = max(sum(needs[rank].on_disk for rank in fit.ranks) for fit in fits)
    notes = []
    if not flags.max_model_len:
        notes.append(
            f"max-model-len is the model's max_position_embeddings ({max_model_len:,}): the "
            "recipe sets none"
        )
    if on_disk:
        notes.append(
            "Engram tables stay on disk (--engram-config table_memory disk): "
            f"{human_bytes(on_disk)} a node left out of the weights"
        )
    if len(models) > 1:
        notes.append(f"drafter {models[1].repo}: weights and KV cache counted on every rank")
    return FitReport(
        model=models[0].repo,
        max_model_len=max_model_len,
        max_num_seqs=flags.max_num_seqs,
        kv_cache_dtype=flags.kv_cache_dtype,
        gpu_memory_utilization=flags.gpu_memory_utilization,
        kv_cache_memory_source=flags.kv_cache_memory_source,
        nodes=fits,
        notes=notes,
        warnings=[warning for fit in fits for warning in _warnings(plan, fit, max_model_len)],
        refusal=_refusal(plan, fits, max_model_len),
    )


def _node_fit(
    plan: Plan, node: NodePlan, needs: dict[int, _RankNeeds], request_tokens: int
) -> NodeFit:
    flags = plan.memory.flags
    ranks = node_ranks(plan, node)
    weights = sum(needs[rank].weights for rank in ranks)
    token_bytes = sum(needs[rank].token_bytes for rank in ranks)
    overhead = node.memory.engine_overhead_bytes * len(ranks)
    pinned = flags.kv_cache_memory_bytes
    if pinned is None:
        budget = plan.memory.required_free_bytes(node.memory)
        kv_cache = budget - weights - overhead
    else:
        budget = node.memory.total_bytes
        kv_cache = pinned * len(ranks)
    request = request_tokens * token_bytes
    headroom = kv_cache - request if pinned is None else budget - weights - overhead - kv_cache
    blocks = max(0, kv_cache) // (token_bytes * flags.block_size) if token_bytes else 0
    verdict: Verdict = "fits"
    if kv_cache < request or headroom < 0:
        verdict = "does not fit"
    elif headroom < TIGHT_MARGIN * budget:
        verdict = "tight"
    return NodeFit(
        node=node.node,
        ranks=ranks,
        weights_bytes=weights,
        overhead_bytes=overhead,
        kv_bytes_per_token=token_bytes,
        kv_request_bytes=request,
        kv_requests_bytes=request * flags.max_num_seqs if flags.max_num_seqs else None,
        kv_cache_bytes=kv_cache,
        budget_bytes=budget,
        headroom_bytes=headroom,
        kv_tokens=blocks * flags.block_size,
        verdict=verdict,
    )


def _budget_text(plan: Plan, fit: NodeFit) -> str:
    flags = plan.memory.flags
    node = next(node for node in plan.nodes if node.node == fit.node)
    memory = f"the inventory's memory_gib {node.memory.total_bytes / (1 << 30):g} GiB"
    if flags.kv_cache_memory_bytes is not None:
        return f"{memory}: a pinned KV cache ignores the utilization"
    return f"--gpu-memory-utilization {flags.gpu_memory_utilization:g} x {memory}"


def _warnings(plan: Plan, fit: NodeFit, max_model_len: int) -> list[str]:
    warnings = []
    if fit.verdict == "tight":
        warnings.append(
            f"node {fit.node}: fits with {human_bytes(fit.headroom_bytes)} to spare, under the "
            f"{TIGHT_MARGIN:.0%} margin of its {human_bytes(fit.budget_bytes)} budget: the "
            "estimate's error could be more; lower --max-model-len or --max-num-seqs, or use "
            "more nodes"
        )
    wanted = fit.kv_requests_bytes
    if fit.verdict != "does not fit" and wanted is not None and fit.kv_cache_bytes < wanted:
        held = fit.kv_cache_bytes / fit.kv_request_bytes
        warnings.append(
            f"node {fit.node}: the KV cache ({human_bytes(fit.kv_cache_bytes)}) holds {held:.1f}"
            f" requests of {max_model_len:,} tokens, fewer than --max-num-seqs "
            f"{plan.memory.flags.max_num_seqs} ({human_bytes(wanted)}): full-length requests "
            "beyond that wait for memory"
        )
    return warnings


def _refusal(plan: Plan, fits: Sequence[NodeFit], max_model_len: int) -> str | None:
    short = [fit for fit in fits if fit.verdict == "does not fit"]
    if not short:
        return None
    flags = plan.memory.flags
    lines = [f"recipe {plan.recipe} does not fit the memory of cluster {plan.cluster}:"]
    for fit in short:
        kv_cache = max(fit.kv_cache_bytes, fit.kv_request_bytes)
        need = fit.weights_bytes + fit.overhead_bytes + kv_cache
        lines.append(
            f"node {fit.node}: weights {human_bytes(fit.weights_bytes)} + engine overhead "
            f"{human_bytes(fit.overhead_bytes)} + KV cache {human_bytes(kv_cache)} = "
            f"{human_bytes(need)}"
            f" against a budget of {human_bytes(fit.budget_bytes)} ({_budget_text(plan, fit)}); "
            f"one request of {max_model_len:,} tokens needs {human_bytes(fit.kv_request_bytes)}"
            f" of KV cache, which holds {max(0, fit.kv_tokens):,} tokens"
        )
    lines.append("turn one of these knobs:")
    tokens = min(fit.kv_tokens for fit in short)
    if flags.kv_cache_memory_bytes is None:
        if tokens > 0:
            lines.append(f"- --max-model-len {tokens} or lower (the KV cache left holds that)")
        if flags.kv_cache_dtype in ("auto", "bfloat16", "float16"):
            lines.append("- --kv-cache-dtype fp8 (half the KV cache of a 16-bit one)")
        if flags.gpu_memory_utilization < 0.95:
            lines.append(
                f"- a higher --gpu-memory-utilization (now {flags.gpu_memory_utilization:g})"
            )
    else:
        lines.append(
            f"- the pinned KV cache ({flags.kv_cache_memory_source}): enough for one request of "
            "max-model-len, and within the node once weights and overhead are in"
        )
        lines.append("- --max-model-len lower")
    lines.append(
        "- a higher tensor_parallel_size over more nodes (required_nodes): splits the weights and"
        " the KV heads"
    )
    if any(fit.weights_bytes + fit.overhead_bytes >= fit.budget_bytes for fit in short):
        lines.append("- a smaller checkpoint (quantized weights)")
    return "\n".join(lines)


def fit_report(plan: Plan) -> FitReport:
    """The plan's fit, from the model (and drafter) in the plan's NAS cache."""
    memory = plan.memory
    models = [read_model(plan.nas_hf_cache, memory.model, memory.model_revision)]
    if memory.drafter is not None:
        models.append(read_model(plan.nas_hf_cache, memory.drafter, None))
    return estimate(plan, models)
