"""Plain local files on the nodes: run sparkdeploy.node.stage_plain on each, turn its answer into
data.

One python3 on the node per call, for all the node's plain files. A file from the NAS is read
by the node through its own mount; a file from the ops host (this host) travels on the script's
stdin, and only when the node asks for it: the first call sends none, the node answers which
it still needs (the others it found in place, trusted by their manifest or adopted), and a
second call sends those. See sparkdeploy.node.stage_plain for the checks on the node.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from sparkdeploy.errors import RemoteError, StagingError
from sparkdeploy.node import hfcache as node_hfcache
from sparkdeploy.node import stage_plain as node_plain
from sparkdeploy.node.stage_plain import PlainResult
from sparkdeploy.remote.docker_cli import on_nodes
from sparkdeploy.remote.node_script import (
    STDERR_TAIL_CHARS,
    PythonRunner,
    build_node_script,
    last_json_line,
)
from sparkdeploy.remote.targets import node_target
from sparkdeploy.spec.plan import NodePlan, PlainStage, Plan

# Plain files are configs, tokenizers, templates: the base covers a NAS file of a few GB too;
# the ops host's bytes add their transfer at the slowest healthy rate.
TIMEOUT_BASE_S = 600.0
MIN_BYTES_PER_S = 10 * 1000 * 1000


@cache
def node_script() -> str:
    return build_node_script(node_plain, [node_hfcache])


def stage_plain_on_node(
    runner: PythonRunner,
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
    runner: PythonRunner,
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
    answer = last_json_line(completed.stdout)
    if answer is None:
        stderr = completed.stderr.decode("utf-8", "replace")
        raise RemoteError(
            f"node {node}: the plain file script ({_describe(stages)}) exited "
            f"{completed.exit_code} without an answer; a re-run starts it again; stderr ends "
            f"with: {stderr[-STDERR_TAIL_CHARS:]}"
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
    staged = {node.node: node for node in plan.nodes if node.plain}
    return on_nodes(
        {name: node_target(node) for name, node in staged.items()},
        lambda runner, name: stage_plain_on_node(
            runner,
            name,
            nas_hf_cache=plan.nas_hf_cache,
            stages=staged[name].plain,
            composed_root=_composed_root(staged[name]),
        ),
    )


def _composed_root(node: NodePlan) -> str | None:
    return node.composed.root if node.composed is not None else None


def _describe(stages: Sequence[PlainStage]) -> str:
    return "; ".join(
        f"{stage.repo.repo if stage.repo else stage.ops_file}: {stage.filename} to {stage.dest}"
        for stage in stages
    )
