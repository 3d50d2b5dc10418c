"""Disk hygiene: what deployments left on the nodes, and what no recipe reads on the NAS, listed
with its bytes and removed only when nothing could still want it.

On each node (sparkdeploy.node.prune lists and removes there):
- a composed dir (`<composed_root>/<deployment id>`) goes when that deployment neither runs (no
  container of it on any node, running or stopped) nor holds a node, and the dir is older than
  the age; one without our key is not ours and stays;
- a local file (an Engram copy or a plain file, at a path a composed dir's key names) goes when
  no recipe under recipes/ names its path, every composed dir linking it goes too, no other hard
  link holds it (another lane's), our manifest is beside it (else it is nobody's copy we know)
  and it is older than the age. A node held by a deployment that has not booted keeps all its
  files: what that deployment stages is not known before its composed dir exists.
On the NAS HF cache:
- a revision (`snapshots/<sha>`) goes when no recipe's revision resolves to it (a pinned sha, or
  the commit the cache's refs/<branch> names), no running deployment reads it (its plan's
  revisions; a composed dir that stays points at its commits) and it is older than the age; its
  blobs go with it unless a revision that stays links them, and so do our manifest, the
  commit's file list and the refs that named it;
- a partial download (`blobs/*.incomplete`) goes when untouched for a day.
A deployment that runs or holds nodes but cannot be planned again (an orphan, a variant) leaves
the NAS untouched: what it reads is not known. A recipe that cannot be read leaves every local
file and the NAS untouched, for the same reason. Removal happens under the repo's prefetch
lock (a repo a prefetch holds is left alone) and, on a node, only for what is still as it was
listed, after the node locks are read again.

One module per job:
  __init__.py   prune(): the nodes, then the NAS, decided and (unless a dry run) removed
  in_use.py     what must stay: the recipes' local files and revisions, what runs or holds nodes
  nodes.py      a node's composed dirs and local files decided; the node script asked to remove
  nas.py        the NAS cache's revisions and partial downloads decided and removed
  rows.py       a candidate and its reason, the table's rows (a node's from its answer), the
                summary
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sparkdeploy.remote.docker_cli import on_nodes
from sparkdeploy.remote.targets import cluster_targets
from sparkdeploy.spec.cluster import Cluster
from sparkdeploy.steps.prune.in_use import Holders, InUse, deployments_in_use, recipes_in_use
from sparkdeploy.steps.prune.nas import prune_nas
from sparkdeploy.steps.prune.nodes import call_node, decide_node, remove_on_nodes
from sparkdeploy.steps.prune.rows import Log, PruneRow, node_rows
from sparkdeploy.steps.status import DeploymentStatus

# A week: a revision a recipe named last week is often named again after a revert, and its
# download costs more than its disk for a week.
DEFAULT_MIN_AGE_HOURS = 24 * 7


def prune(
    cluster: Cluster,
    recipes_dir: Path,
    statuses: Sequence[DeploymentStatus],
    read_holders: Callable[[], Holders],
    *,
    dry_run: bool = True,
    min_age_hours: float = DEFAULT_MIN_AGE_HOURS,
    log: Log = print,
) -> list[PruneRow]:
    """The nodes' composed dirs and local files, then the NAS, decided as the module says; in a
    real run (dry_run False) removed. read_holders is asked again right before the nodes'
    removal: a node a deployment took meanwhile is left alone."""
    now, min_age_s = time.time(), min_age_hours * 3600
    cache_dir = Path(cluster.nas.hf_cache)
    held = read_holders()
    in_use = InUse()
    recipes_in_use(recipes_dir, cache_dir, in_use)
    deployments_in_use(cache_dir, statuses, held, in_use)
    composed_root = cluster.node_paths.composed_root
    list_request = {
        "action": "list",
        "composed_root": composed_root,
        "local_files": sorted(in_use.named_paths),
    }
    listings = on_nodes(
        cluster_targets(cluster), lambda runner, node: call_node(runner, node, list_request)
    )
    decided = {
        node: decide_node(node, listing, in_use, now, min_age_s)
        for node, listing in listings.items()
    }
    # A composed dir that stays keeps the NAS commits its snapshot links point at.
    for node, listing in listings.items():
        staying = {c.path for c in decided[node] if c.what == "composed dir" and not c.remove}
        for entry in listing["composed"]:
            if entry["path"] in staying:
                for source in entry["commits"]:
                    in_use.keep_revision(
                        source["repo"],
                        source["commit"],
                        f"the composed dir {entry['name']} on {node}, which stays, links it",
                    )
    answers: dict[str, dict[str, Any] | None] = dict.fromkeys(decided)
    if not dry_run:
        answers.update(remove_on_nodes(cluster, decided, held, read_holders(), log))
    rows = [
        row for node in decided for row in node_rows(decided[node], answers[node], dry_run=dry_run)
    ]
    return rows + prune_nas(cache_dir, in_use, now, min_age_s, dry_run=dry_run, log=log)
