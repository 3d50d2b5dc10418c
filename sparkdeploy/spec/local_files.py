"""Which kind of stage a recipe's [[composed_model.local_files]] entry is, and why.

- "engram": a per-rank sparse copy of an Engram table shard (sparkdeploy.node.engram_copy);
- "plain": the file put whole (sparkdeploy.node.plain_copy): a patched config, a tokenizer, a
  chat template...

The recipe's `kind` wins; a file from the ops host (`from_file`) is plain (an Engram copy is
made from the NAS on each node). Otherwise the NAS cache decides, read on this host as the fit
check reads it, by the best rule it allows:

1. a name not ending in .safetensors: plain (no NAS needed);
2. the shard and config.json in the NAS: engram if the shard's safetensors header names an
   Engram table of the model (config.json's engram_* keys give the layers), else plain;
3. config.json only (the shard not fetched yet): engram if it has engram_* keys, else plain;
4. neither (a first deploy plans before its prefetch): engram, as a .safetensors local file was
   before plain files existed; a wrong guess fails the Engram staging with its fix.

The rule that decided is returned with the kind, for `sparkdeploy plan` to show.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any, Literal

from sparkdeploy.errors import EngramError
from sparkdeploy.node.engram import EngramGeometry, read_safetensors_header, weight_tensor_name
from sparkdeploy.node.hfcache import SnapshotNotFound, resolve_snapshot
from sparkdeploy.spec.recipe import ComposedLocalFile, RepoRef

Kind = Literal["engram", "plain"]


def local_file_kind(
    local: ComposedLocalFile, source: RepoRef, nas_hf_cache: str
) -> tuple[Kind, str]:
    """(kind, the rule that decided it, in words) of one local file whose NAS counterpart is
    the file of the same name in `source`'s snapshot."""
    name = posixpath.basename(local.host)
    if local.kind is not None:
        return local.kind, 'set in the recipe (kind = "' + local.kind + '")'
    if local.from_file is not None:
        return "plain", f"from the ops host ({local.from_file})"
    if not name.endswith(".safetensors"):
        return "plain", "not a safetensors file"
    where = f"{source.repo}@{source.revision or 'main'} in {nas_hf_cache}"
    try:
        _, snapshot = resolve_snapshot(nas_hf_cache, source.repo, source.revision)
    except SnapshotNotFound:
        return "engram", (
            f"a safetensors file, assumed an Engram shard: {where} is not readable here to tell;"
            ' set kind = "plain" on it if it is not one'
        )
    config = _read_config(posixpath.join(snapshot, "config.json"))
    try:
        geometry = EngramGeometry.from_config(config) if config is not None else None
    except EngramError as exc:
        return "engram", f"config.json has engram_* keys the staging will refuse: {exc}"
    if config is None:
        return "engram", (
            f"a safetensors file, assumed an Engram shard: config.json of {where} is not "
            'readable here to tell; set kind = "plain" on it if it is not one'
        )
    if geometry is None:
        return "plain", "config.json has no engram_* keys: the model has no Engram tables"
    try:
        _, tensors, _ = read_safetensors_header(posixpath.join(snapshot, name))
    except (OSError, EngramError):
        return "engram", (
            "a safetensors file and config.json has engram_* keys (the shard itself is not "
            "readable here yet)"
        )
    layers = [layer for layer in geometry.layer_ids if weight_tensor_name(layer) in tensors]
    if layers:
        return "engram", f"holds the Engram tables of layers {', '.join(map(str, layers))}"
    return "plain", "a safetensors file without Engram tables"


def _read_config(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as config_file:
            config = json.load(config_file)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
