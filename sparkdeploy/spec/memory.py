"""What a deployment asks of each node's memory, and what the fit check found (plain data).

`read_memory_flags` reads the recipe's vLLM flags and env that size the engine's memory, the way
vLLM reads them; the plan (sparkdeploy.spec.plan) carries the result with each node's memory from
the inventory; sparkdeploy.steps.fit sets them against the model's sizes before anything is put on a
node, and the preflight (sparkdeploy.steps.boot) against the free memory a node has. How the figures
add up, and where vLLM says so: docs/field.md#memory-fit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict

from sparkdeploy.spec.tomlfile import KeyPath
from sparkdeploy.units import GIB, human_bytes
from sparkdeploy.vllm.args import VllmArgs

# vLLM's defaults (vllm-project/vllm vllm/config/cache.py, CacheConfig).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
DEFAULT_BLOCK_SIZE = 16
# vLLM's CPU backend reads this env, in GiB per rank, as --kv-cache-memory-bytes
# (vllm/platforms/cpu.py): the lab's real-engine recipes pin their KV cache with it.
CPU_KVCACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
# A fit with less headroom than this share of the node's budget is reported as tight.
TIGHT_MARGIN = 0.05

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def human_readable_int(text: str) -> int:
    """vLLM's reading of lengths and sizes: 1k = 1000, 1K = 1024, 25.6k = 25600
    (vllm/utils/argparse_utils.py, human_readable_int). ValueError otherwise."""
    value = text.strip()
    suffix = value[-1:]
    if suffix in _DECIMAL:
        return int(float(value[:-1]) * _DECIMAL[suffix])
    if suffix in _BINARY:
        return int(value[:-1]) * _BINARY[suffix]
    return int(value)


class MemoryFlags(_Data):
    """The recipe's flags and env that size the engine's memory; None: vLLM decides."""

    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int | None = None  # None: vLLM's default for the device
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory_bytes: int | None = None  # per rank; vLLM then ignores the utilization
    kv_cache_memory_source: str | None = None  # the flag or env that pinned it
    decode_context_parallel_size: int = 1
    engram_on_disk: bool = False  # --engram-config table_memory "disk": tables stay on disk


def read_memory_flags(
    args: VllmArgs, env: Mapping[str, str]
) -> tuple[MemoryFlags, list[tuple[KeyPath, str]]]:
    """The flags, and each value vLLM would refuse (its key in the recipe, the problem)."""
    values: dict[str, object] = {}
    problems: list[tuple[KeyPath, str]] = []

    def read(flag: str, field: str, *, fraction: bool = False) -> None:
        found = args.find(flag)
        text = (found.value or "").strip() if found is not None else ""
        if found is None or (field == "max_model_len" and text in ("auto", "-1")):
            return
        try:
            value: float = float(text) if fraction else human_readable_int(text)
        except ValueError:
            value = -1
        if not (0 < value <= 1 if fraction else value >= 1):
            wanted = (
                "a fraction in (0, 1], like 0.9"
                if fraction
                else "a whole number, like 4096 (vLLM also reads 4k = 4000 and 4K = 4096)"
            )
            problems.append((("args", found.index), f"{flag} {found.value!r} is not {wanted}"))
            return
        values[field] = value

    read("--max-model-len", "max_model_len")
    read("--max-num-seqs", "max_num_seqs")
    read("--block-size", "block_size")
    read("--gpu-memory-utilization", "gpu_memory_utilization", fraction=True)
    read("--decode-context-parallel-size", "decode_context_parallel_size")
    read("--kv-cache-memory-bytes", "kv_cache_memory_bytes")
    if "kv_cache_memory_bytes" in values:
        values["kv_cache_memory_source"] = "--kv-cache-memory-bytes"
    elif env.get(CPU_KVCACHE_ENV, "") not in ("", "0"):
        space = env[CPU_KVCACHE_ENV]
        if space.isdigit():
            values["kv_cache_memory_bytes"] = int(space) * GIB
            values["kv_cache_memory_source"] = f"{CPU_KVCACHE_ENV}={space}"
        else:
            problems.append(
                (("env", CPU_KVCACHE_ENV), f"env.{CPU_KVCACHE_ENV} {space!r} is not a whole GiB")
            )
    for flag, field in (("--dtype", "dtype"), ("--kv-cache-dtype", "kv_cache_dtype")):
        found = args.find(flag)
        if found is not None and found.value:
            values[field] = found.value.lower()
    engram = args.find("--engram-config")
    if engram is not None and isinstance(engram.json_value, dict):
        values["engram_on_disk"] = engram.json_value.get("table_memory") == "disk"
    return MemoryFlags.model_validate(values), problems


class NodeMemory(_Data):
    """A node's memory as its inventory declares it."""

    total_bytes: int
    unified: bool  # the GPU allocates from the host's RAM (GB10)
    engine_overhead_bytes: int  # per rank, beside weights and KV cache


class EngineMemory(_Data):
    """What every node of the deployment loads: the model (and drafter) split over the ranks."""

    model: str
    model_revision: str | None
    drafter: str | None  # --speculative-config's model repo, loaded by every rank too
    tensor_parallel_size: int
    pipeline_parallel_size: int
    flags: MemoryFlags

    def required_free_bytes(self, node: NodeMemory) -> int:
        """What vLLM wants free when it starts: utilization x the device's total
        (vllm/v1/worker/utils.py, request_memory: "Free memory on device ... on startup")."""
        return math.ceil(node.total_bytes * self.flags.gpu_memory_utilization)


Verdict = Literal["fits", "tight", "does not fit"]


class NodeFit(_Data):
    """One node's figures, every rank on it together (sparkdeploy.steps.fit)."""

    node: str
    ranks: list[int]
    weights_bytes: int
    overhead_bytes: int
    kv_bytes_per_token: int  # this node's ranks' share of one token's KV cache
    kv_request_bytes: int  # one request of max_model_len: what vLLM needs to start
    kv_requests_bytes: int | None  # max_num_seqs such requests, when the recipe says how many
    kv_cache_bytes: int  # what the KV cache gets: pinned, or what the budget leaves
    budget_bytes: int  # the engine's share of the node's memory
    # Beyond what must fit: with a pinned KV cache, the budget left over; otherwise the KV cache
    # beyond one full-length request. Negative: it does not fit.
    headroom_bytes: int
    kv_tokens: int  # the KV cache's capacity, as vLLM logs it ("KV cache size: N tokens")
    verdict: Verdict

    def line(self) -> str:
        return (
            f"node {self.node}: {self.verdict}: weights {human_bytes(self.weights_bytes)}, "
            f"overhead {human_bytes(self.overhead_bytes)}, KV cache "
            f"{human_bytes(self.kv_cache_bytes)} ({self.kv_tokens:,} tokens; one request "
            f"{human_bytes(self.kv_request_bytes)}), budget {human_bytes(self.budget_bytes)}, "
            f"headroom {human_bytes(self.headroom_bytes)}"
        )


class FitReport(_Data):
    """The fit check's figures for every node of a plan, and what to do when they are short."""

    model: str
    max_model_len: int
    max_num_seqs: int | None
    kv_cache_dtype: str
    gpu_memory_utilization: float
    kv_cache_memory_source: str | None
    nodes: list[NodeFit]
    notes: list[str]  # what the estimate leaves out or assumed
    warnings: list[str]  # fits, but: tight, or fewer concurrent requests than max_num_seqs
    refusal: str | None  # why it cannot fit and the knobs to turn; None when it fits

    def table(self) -> list[str]:
        """A markdown table of the per-node figures."""
        rows = [
            "| node | weights | overhead | KV cache | one request | budget | headroom | "
            "KV tokens | verdict |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        rows.extend(
            f"| {fit.node} | {human_bytes(fit.weights_bytes)} | "
            f"{human_bytes(fit.overhead_bytes)} | {human_bytes(fit.kv_cache_bytes)} | "
            f"{human_bytes(fit.kv_request_bytes)} | {human_bytes(fit.budget_bytes)} | "
            f"{human_bytes(fit.headroom_bytes)} | {fit.kv_tokens:,} | {fit.verdict} |"
            for fit in self.nodes
        )
        return rows

    def markdown(self) -> str:
        lines = [f"Memory fit of {self.summary_line()}", "", *self.table()]
        lines += ["", *(f"- {note}" for note in self.notes)] if self.notes else []
        lines += ["", *(f"- **{warning}**" for warning in self.warnings)] if self.warnings else []
        if self.refusal is not None:
            lines += ["", "**Does not fit:**", "", "```", self.refusal, "```"]
        return "\n".join(lines)

    def summary_line(self) -> str:
        pinned = (
            f", KV pinned by {self.kv_cache_memory_source}" if self.kv_cache_memory_source else ""
        )
        seqs = f" x {self.max_num_seqs} seqs" if self.max_num_seqs else ""
        return (
            f"{self.model}: max-model-len {self.max_model_len:,}{seqs}, kv-cache-dtype "
            f"{self.kv_cache_dtype}, gpu-memory-utilization {self.gpu_memory_utilization:g}"
            f"{pinned}"
        )
