"""sparkdeploy.node.probe run on a node: one python3 per question, its JSON answer returned."""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from typing import Any

from sparkdeploy.errors import RemoteError
from sparkdeploy.node import probe as node_probe
from sparkdeploy.remote.node_script import build_node_script, last_json_line
from sparkdeploy.remote.runner import Runner, stderr_text

PROBE_TIMEOUT_S = 90.0


@cache
def probe_script(write_code_cache: bool = True) -> str:
    return build_node_script(node_probe, write_code_cache=write_code_cache)


def probe(
    runner: Runner,
    node: str,
    mode: str,
    request: Mapping[str, Any],
    *,
    read_only: bool = False,
) -> dict[str, Any]:
    """sparkdeploy.node.probe's answer from the node (see its docstring for the modes);
    read_only: the script writes nothing there, not even its code cache (a preview)."""
    result = runner.run_python(
        probe_script(not read_only),
        [mode, json.dumps(dict(request))],
        timeout=PROBE_TIMEOUT_S,
        check=False,
    )
    answer = last_json_line(result.stdout)
    if result.exit_code != 0 or answer is None:
        raise RemoteError(
            f"node {node}: the probe script ({mode}) exited {result.exit_code} without an"
            f" answer; stderr: {stderr_text(result) or '(empty)'}; is python3 installed there?"
        )
    return answer
