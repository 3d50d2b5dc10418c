"""Staging in a preview: what stage-engram would do with each shard of each node, by the staging
script's dry run (which writes nothing, not even its code cache), and what compose-model would
do with each composed dir."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from sparkdeploy.errors import StagingError
from sparkdeploy.node import engram_copy
from sparkdeploy.remote.node_script import build_node_script, last_json_line
from sparkdeploy.remote.runner import STDERR_TAIL_CHARS, Runner
from sparkdeploy.remote.ssh import SshTarget
from sparkdeploy.spec.plan import EngramStage, Plan
from sparkdeploy.steps.preview.model import Action, Rates, Row, timed
from sparkdeploy.steps.preview.nodes import per_node
from sparkdeploy.steps.stage_engram import node_request

# The node script's words for a shard (engram_copy.preview_all) as a preview's actions.
_SHARD_ACTIONS: dict[str, Action] = {
    "skip": "none",
    "adopt": "adopt",
    "copy": "copy",
    "resume": "resume",
    "refuse": "refuse",
}
# The dry run reads headers, configs and a few samples: as long as staging's own silence bound.
ENGRAM_DRY_RUN_TIMEOUT_S = 120.0


@cache
def _engram_script() -> str:
    return build_node_script(engram_copy, write_code_cache=False)


def engram_dry_run(
    runner: Runner,
    node: str,
    *,
    nas_hf_cache: str,
    stages: Sequence[EngramStage],
    composed_root: str | None,
) -> list[dict[str, Any]]:
    """The staging script's dry run on one node: per shard {"dest", "action", "bytes", "why"}
    (sparkdeploy.node.engram_copy.preview_all), from the request the step itself sends
    (sparkdeploy.steps.stage_engram.node_request)."""
    request = node_request(
        node, nas_hf_cache=nas_hf_cache, stages=stages, composed_root=composed_root
    )
    completed = runner.run_python(
        _engram_script(),
        [json.dumps({**request, "dry_run": True})],
        timeout=ENGRAM_DRY_RUN_TIMEOUT_S,
        check=False,
    )
    answer = last_json_line(completed.stdout)
    if answer is None or not answer.get("ok"):
        why = (
            f"[{answer.get('kind')}] {answer.get('message')}"
            if answer
            else completed.stderr.decode("utf-8", "replace")[-STDERR_TAIL_CHARS:]
        )
        raise StagingError(f"node {node}: the staging dry run failed: {why}")
    shards = []
    for line in completed.stdout.decode("utf-8", "replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            found = json.loads(line)
            if isinstance(found, dict) and "preview" in found:
                shards.append(found["preview"])
    return shards


def engram_rows(plan: Plan, targets: Mapping[str, SshTarget], rates: Rates) -> list[Row]:
    """What stage-engram would do with each shard of each node (engram_dry_run)."""
    staged = {node.node: node for node in plan.nodes if node.engram}

    def dry_run(runner: Runner, name: str) -> list[dict[str, Any]]:
        node = staged[name]
        return engram_dry_run(
            runner,
            name,
            nas_hf_cache=plan.nas_hf_cache,
            stages=node.engram,
            composed_root=node.composed_root,
        )

    rows = []
    for name, found in per_node({n: targets[n] for n in staged}, dry_run).items():
        if isinstance(found, str):
            rows += [
                Row("stage-engram", name, stage.dest, "unknown", None, found)
                for stage in staged[name].engram
            ]
            continue
        for shard in found:
            action = _SHARD_ACTIONS[shard["action"]]
            row = Row("stage-engram", name, shard["dest"], action, shard["bytes"], shard["why"])
            moving = action in ("copy", "resume", "adopt")
            rows.append(timed(row, shard["bytes"], rates.nas_to_disk(name)) if moving else row)
    return rows


def compose_rows(plan: Plan, engram: Sequence[Row]) -> list[Row]:
    """compose-model has no dry run: it keeps a composed dir whose key (the sources' snapshots,
    the local files' inode, size and mtime) still matches, else rebuilds it, links only."""
    rows = []
    for node in plan.nodes:
        if node.composed is None:
            continue
        renewed = [
            row.subject
            for row in engram
            if row.node == node.node and row.action in ("copy", "resume")
        ]
        detail = (
            f"rebuilt: the Engram copies {', '.join(renewed)} are new files"
            if renewed
            else "kept if its key still matches, else (re)built"
        )
        rows.append(
            Row(
                "compose-model",
                node.node,
                node.composed.root,
                "compose",
                0,
                f"{detail} (symlinks to the NAS and hardlinks: no data is copied)",
            )
        )
    return rows
