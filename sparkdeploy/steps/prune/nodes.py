"""The nodes' side of a prune: each node's listing (sparkdeploy.node.prune.list_node) decided,
and the removal asked of the node script where nothing took the node meanwhile."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from sparkdeploy.errors import RemoteError
from sparkdeploy.node import prune as node_prune
from sparkdeploy.remote.docker_cli import on_nodes
from sparkdeploy.remote.node_script import build_node_script, last_json_line
from sparkdeploy.remote.runner import STDERR_TAIL_CHARS, Runner
from sparkdeploy.remote.targets import cluster_targets
from sparkdeploy.spec.cluster import Cluster
from sparkdeploy.steps.prune.in_use import Holders, InUse
from sparkdeploy.steps.prune.rows import Candidate, Log, hours

# Listing walks the composed dirs (symlinks only) and stats the local files: seconds; removing
# a large sparse copy may take longer on a slow disk.
NODE_TIMEOUT_S = 600.0


def decide_node(
    node: str, listing: Mapping[str, Any], in_use: InUse, now: float, min_age_s: float
) -> list[Candidate]:
    """What of a node's listing (sparkdeploy.node.prune.list_node) may go, and why."""
    found: list[Candidate] = []
    going: set[str] = set()
    for entry in listing["composed"]:
        age = now - entry["mtime"]
        name = entry["name"]
        if not entry["ours"]:
            remove, why = False, "no sparkdeploy key (CACHEDIR.TAG) in it: not ours"
        elif name in in_use.deployments:
            remove, why = False, in_use.deployments[name]
        elif age < min_age_s:
            remove, why = False, f"composed {hours(age)} ago, newer than {hours(min_age_s)}"
        else:
            remove, why = True, f"deployment {name} neither runs nor holds a node"
        if remove:
            going.add(name)
        found.append(
            Candidate(
                "composed dir",
                node,
                entry["path"],
                entry["bytes"],
                remove,
                why,
                {"kind": "composed", "path": entry["path"], "mtime_ns": entry["mtime_ns"]},
            )
        )
    found.extend(
        _decide_file(node, entry, going, in_use, now, min_age_s)
        for entry in listing["files"]
        if entry["exists"]
    )
    return found


def _decide_file(
    node: str,
    entry: Mapping[str, Any],
    going: set[str],
    in_use: InUse,
    now: float,
    min_age_s: float,
) -> Candidate:
    path = entry["path"]
    if not entry["regular"]:
        return Candidate("local file", node, path, 0, False, "not a regular file: not ours")
    linked: dict[str, int] = entry["linked_from"]
    other_links = entry["nlink"] - 1 - sum(linked.values())
    staying = sorted(name for name in linked if name not in going)
    age = now - entry["mtime"]
    why: str | None = None
    if path in in_use.named_paths:
        why = f"recipe {', '.join(in_use.named_paths[path])} names it"
    elif in_use.files_doubt is not None:
        why = in_use.files_doubt
    elif node in in_use.busy_nodes:
        why = in_use.busy_nodes[node]
    elif staying:
        why = f"the composed dir of {', '.join(staying)}, which stays, links it"
    elif other_links > 0:
        why = f"{other_links} hard link(s) outside {node}'s composed dirs: another lane holds it"
    elif not entry["manifest"]:
        why = f"no {node_prune.MANIFEST_SUFFIX} beside it: not a copy of ours"
    elif age < min_age_s:
        why = f"changed {hours(age)} ago, newer than {hours(min_age_s)}"
    item = {k: entry[k] for k in ("path", "ino", "size", "mtime_ns")}
    return Candidate(
        "local file",
        node,
        path,
        entry["bytes"],
        why is None,
        why
        or (
            "no recipe names it and no deployment that stays uses it"
            + (f" (linked only by {', '.join(sorted(linked))}, going too)" if linked else "")
        ),
        {"kind": "file", **item},
    )


@cache
def node_script() -> str:
    return build_node_script(node_prune)


def call_node(runner: Runner, node: str, request: Mapping[str, Any]) -> dict[str, Any]:
    """The node script's answer to one request; RemoteError when it gives none or fails."""
    completed = runner.run_python(
        node_script(), [json.dumps(request)], timeout=NODE_TIMEOUT_S, check=False
    )
    answer = last_json_line(completed.stdout)
    if answer is None or not answer.get("ok"):
        detail = (
            answer["message"]
            if answer is not None
            else completed.stderr.decode("utf-8", "replace")[-STDERR_TAIL_CHARS:]
        )
        raise RemoteError(
            f"node {node}: the prune script ({request['action']}) exited {completed.exit_code}:"
            f" {detail}"
        )
    return answer


def remove_on_nodes(
    cluster: Cluster,
    decided: Mapping[str, Sequence[Candidate]],
    before: Holders,
    now_held: Holders,
    log: Log,
) -> dict[str, dict[str, Any]]:
    answers: dict[str, dict[str, Any]] = {}
    asked: dict[str, list[dict[str, Any]]] = {}
    for node, candidates in decided.items():
        items = [c.item for c in candidates if c.remove and c.item is not None]
        if not items:
            continue
        taken = now_held.get(node)
        if taken is not None and taken != before.get(node):
            why = f"deployment {taken} took node {node} after the listing"
            answers[node] = {"removed": [], "kept": dict.fromkeys((i["path"] for i in items), why)}
            log(f"node {node}: nothing removed: {why}")
            continue
        asked[node] = items
    targets = {node: t for node, t in cluster_targets(cluster).items() if node in asked}
    request = {"action": "remove", "composed_root": cluster.node_paths.composed_root}
    answered = on_nodes(
        targets, lambda runner, node: call_node(runner, node, {**request, "items": asked[node]})
    )
    for node, answer in answered.items():
        for path in answer["removed"]:
            log(f"node {node}: removed {path}")
        for path, why in answer["kept"].items():
            log(f"node {node}: kept {path}: {why}")
    return {**answers, **answered}
