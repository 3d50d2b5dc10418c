"""The model repos the lab hub serves: what the lab recipes name, generated on demand.

Generated, never committed: `publish_lab_models` writes them into a hub's repos directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lab.tinymodel import EngramSpec, GeneratedRepo, generate_repo


@dataclass(frozen=True)
class LabModel:
    repo_id: str
    num_shards: int
    total_bytes: int
    engram: EngramSpec | None = None
    tp_size: int | None = None


# DSV4.1-shaped: dense shards, then one Engram table per shard. Three heads give 6 hash
# columns per layer, so each of TP 3's ranks owns two (docs/field.md's split).
TINY_DSV41 = LabModel(
    "lab/tiny-dsv41", num_shards=2, total_bytes=4 << 20, engram=EngramSpec(n_heads=3), tp_size=3
)
TINY_CHAT = LabModel("lab/tiny-chat", num_shards=2, total_bytes=1 << 20)
LAB_MODELS = (TINY_DSV41, TINY_CHAT)


def publish_lab_models(repos_dir: str | os.PathLike[str]) -> dict[str, GeneratedRepo]:
    """Write every lab model into repos_dir (the hub's), replacing older copies."""
    return {
        model.repo_id: generate_repo(
            repos_dir,
            model.repo_id,
            num_shards=model.num_shards,
            total_bytes=model.total_bytes,
            engram=model.engram,
            tp_size=model.tp_size,
        )
        for model in LAB_MODELS
    }
