"""The composed model dir on a node: run sparkdeploy.node.compose_model there, turn its answer into
data.

See sparkdeploy.node.compose_model for the layout (an HF cache of NAS symlinks with the node-local
files hardlinked in) and for how it is swapped in and left alone when unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from sparkdeploy.errors import ComposeError, RemoteError
from sparkdeploy.node import compose_model as node_compose
from sparkdeploy.node import hfcache as node_hfcache
from sparkdeploy.remote.node_script import (
    STDERR_TAIL_CHARS,
    PythonRunner,
    build_node_script,
    last_json_line,
)

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
    return build_node_script(node_compose, [node_hfcache])


def compose_model(
    runner: PythonRunner,
    node: str,
    *,
    root: str,
    nas_hf_cache: str,
    sources: Sequence[tuple[str, str | None]],
    local_files: Sequence[str],
) -> ComposeResult:
    """Make the composed HF cache at `root` on `node` match the sources (repo, revision) and
    local files."""
    request = {
        "root": root,
        "nas_hf_cache": nas_hf_cache,
        "sources": [{"repo": repo, "revision": revision} for repo, revision in sources],
        "local_files": list(local_files),
    }
    completed = runner.run_python(
        node_script(), [json.dumps(request)], timeout=COMPOSE_TIMEOUT_S, check=False
    )
    answer = last_json_line(completed.stdout)
    if answer is None:
        stderr = completed.stderr.decode("utf-8", "replace")
        raise RemoteError(
            f"node {node}: the compose script ({root}) exited {completed.exit_code} without an "
            f"answer; stderr ends with: {stderr[-STDERR_TAIL_CHARS:]}"
        )
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
