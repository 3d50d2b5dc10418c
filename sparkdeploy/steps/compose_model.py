"""The composed model dir on a node: run sparkdeploy.node.compose_model there, turn its answer into
data.

See sparkdeploy.node.compose_model for the layout (an HF cache of NAS symlinks with the node-local
files hardlinked in) and for how it is swapped in and left alone when unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import Any

from sparkdeploy.errors import ComposeError
from sparkdeploy.node import compose_model as node_compose
from sparkdeploy.remote.docker_cli import on_nodes
from sparkdeploy.remote.node_script import build_node_script, script_answer
from sparkdeploy.remote.runner import Runner
from sparkdeploy.remote.targets import node_target
from sparkdeploy.spec.plan import ComposedPlan, Plan

# Symlinks and hardlinks only, no data: a minute is a sick node.
COMPOSE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ComposeResult:
    node: str
    status: str  # "built", "rebuilt" or "unchanged"
    root: str
    sources: tuple[tuple[str, str], ...]  # (repo, snapshot commit)
    hardlinks: tuple[tuple[str, str], ...]  # (local file, composed entry it replaced)


@cache
def node_script() -> str:
    return build_node_script(node_compose)


def compose_on_node(
    runner: Runner, node: str, *, nas_hf_cache: str, composed: ComposedPlan
) -> ComposeResult:
    """Make the composed HF cache at `composed.root` on `node` match the plan's sources and
    local files. The plan's ComposedPlan travels to the node as it is (serialised once)."""
    root = composed.root
    request = {"nas_hf_cache": nas_hf_cache, **composed.model_dump(mode="json")}
    completed = runner.run_python(
        node_script(), [json.dumps(request)], timeout=COMPOSE_TIMEOUT_S, check=False
    )
    answer = script_answer(completed, node, f"the compose script ({root})")
    if not answer.get("ok"):
        raise ComposeError(
            f"node {node}: composing {root} failed [{answer.get('kind')}]: {answer.get('message')}"
        )
    result: dict[str, Any] = answer["result"]
    return ComposeResult(
        node=node,
        status=result["status"],
        root=result["root"],
        sources=tuple((s["repo"], s["commit"]) for s in result["sources"]),
        hardlinks=tuple(
            (local, entry) for local, entries in result["hardlinks"].items() for entry in entries
        ),
    )


def compose_model(plan: Plan) -> dict[str, ComposeResult]:
    """Every node's composed HF cache, all nodes at once; nodes whose plan composes nothing are
    left out."""
    composing = {node.node: node.composed for node in plan.nodes if node.composed is not None}
    return on_nodes(
        {node.node: node_target(node) for node in plan.nodes if node.node in composing},
        lambda runner, name: compose_on_node(
            runner, name, nas_hf_cache=plan.nas_hf_cache, composed=composing[name]
        ),
    )
