"""Plain local files on the nodes: run sparkdeploy.node.plain_copy on each, turn its answer into
data.

One python3 on the node per call, for all the node's plain files. A file from the NAS is read
by the node through its own mount; a file from the ops host (this host) travels on the script's
stdin, and only when the node asks for it: the first call sends none, the node answers which
it still needs (the others it found in place, trusted by their manifest or adopted), and a
second call sends those. See sparkdeploy.node.plain_copy for the checks on the node.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from sparkdeploy.errors import StagingError
from sparkdeploy.node import plain_copy
from sparkdeploy.node.plain_copy import PlainResult
from sparkdeploy.remote.node_script import build_node_script, script_answer
from sparkdeploy.remote.runner import Runner
from sparkdeploy.remote.targets import on_plan_nodes
from sparkdeploy.spec.plan import PlainStage, Plan

# Plain files are configs, tokenizers, templates: the base covers a NAS file of a few GB too;
# the ops host's bytes add their transfer at the slowest healthy rate.
TIMEOUT_BASE_S = 600.0
MIN_BYTES_PER_S = 10 * 1000 * 1000


@cache
def node_script() -> str:
    return build_node_script(plain_copy)


def stage_plain_on_node(
    runner: Runner,
    node: str,
    *,
    nas_hf_cache: str,
    stages: Sequence[PlainStage],
    composed_root: str | None = None,
) -> list[PlainResult]:
    """Each of a node's plain files in place and verified, in the plan's order."""
    answer = _call(runner, node, nas_hf_cache, composed_root, stages, inline=False)
    results = [PlainResult.from_json(result) for result in answer["results"]]
    if answer["need"]:
        sending = [stage for stage in stages if stage.dest in answer["need"]]
        sent = _call(runner, node, nas_hf_cache, composed_root, sending, inline=True)
        results += [PlainResult.from_json(result) for result in sent["results"]]
    order = [stage.dest for stage in stages]
    return sorted(results, key=lambda result: order.index(result.dest))


def _call(
    runner: Runner,
    node: str,
    nas_hf_cache: str,
    composed_root: str | None,
    stages: Sequence[PlainStage],
    *,
    inline: bool,
) -> dict[str, Any]:
    request = {
        "node": node,
        "nas_hf_cache": nas_hf_cache,
        "composed_root": composed_root,
        "files": [{**stage.model_dump(mode="json"), "inline": inline} for stage in stages],
    }
    data = b"".join(_ops_bytes(node, stage) for stage in stages) if inline else b""
    completed = runner.run_python(
        node_script(),
        [json.dumps(request)],
        timeout=TIMEOUT_BASE_S + len(data) / MIN_BYTES_PER_S,
        stdin=data,
        check=False,
    )
    answer = script_answer(
        completed,
        node,
        f"the plain file script ({_describe(stages)})",
        advice="a re-run starts it again",
    )
    if not answer["ok"]:
        raise StagingError(
            f"node {node}: staging plain file {answer.get('dest') or _describe(stages)} failed "
            f"[{answer['kind']}]: {answer['message']}"
        )
    return answer


def _ops_bytes(node: str, stage: PlainStage) -> bytes:
    assert stage.ops_file is not None, "the node asks only for ops host files"
    try:
        return Path(stage.ops_file).read_bytes()
    except OSError as exc:
        raise StagingError(
            f"node {node}: {stage.ops_file} (for {stage.dest}) cannot be read on this host: "
            f"{exc.strerror or exc}; restore the file (the recipe's from_file) and deploy again"
        ) from None


def stage_plain(plan: Plan) -> dict[str, list[PlainResult]]:
    """Every node's plain files, all nodes at once; nodes with none are left out."""
    return on_plan_nodes(
        [node for node in plan.nodes if node.plain],
        lambda runner, node: stage_plain_on_node(
            runner,
            node.node,
            nas_hf_cache=plan.nas_hf_cache,
            stages=node.plain,
            composed_root=node.composed_root,
        ),
    )


def _describe(stages: Sequence[PlainStage]) -> str:
    return "; ".join(
        f"{stage.repo.repo if stage.repo else stage.ops_file}: {stage.filename} to {stage.dest}"
        for stage in stages
    )
