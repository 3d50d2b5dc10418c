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
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from sparkdeploy.errors import PrefetchError, RecipeError, RemoteError
from sparkdeploy.node import compose_model as node_compose
from sparkdeploy.node import hfcache as node_hfcache
from sparkdeploy.node import prune as node_prune
from sparkdeploy.remote.docker_cli import on_nodes
from sparkdeploy.remote.node_script import (
    STDERR_TAIL_CHARS,
    PythonRunner,
    build_node_script,
    last_json_line,
)
from sparkdeploy.remote.targets import cluster_targets
from sparkdeploy.spec.cluster import Cluster
from sparkdeploy.spec.recipe import RepoRef, load_recipe, recipe_id_for, recipe_paths
from sparkdeploy.steps.prefetch.cache import (
    MANIFEST_DIRNAME,
    PARTIAL_SUFFIX,
    read_ref,
    storage_dir,
)
from sparkdeploy.steps.prefetch.lock import repo_lock
from sparkdeploy.steps.prefetch.names import is_commit_sha
from sparkdeploy.steps.prefetch.progress import SilentObserver
from sparkdeploy.steps.status import DeploymentStatus
from sparkdeploy.units import human_bytes

# A week: a revision a recipe named last week is often named again after a revert, and its
# download costs more than its disk for a week.
DEFAULT_MIN_AGE_HOURS = 24 * 7
# A partial download this old belongs to a prefetch that died (a live one writes every second,
# and one retried by its task resumes within minutes).
PARTIAL_MIN_AGE_HOURS = 24
# Listing walks the composed dirs (symlinks only) and stats the local files: seconds; removing
# a large sparse copy may take longer on a slow disk.
NODE_TIMEOUT_S = 600.0

REMOVED, WOULD_REMOVE, KEPT = "removed", "would remove", "kept"
NAS = "NAS"

# node -> the deployment holding it (None: free), as the node lock records say
Holders = Mapping[str, str | None]
Log = Callable[[str], None]


@dataclass(frozen=True)
class Candidate:
    """Something the prune found, and whether it may go (why, either way). `item` is what the
    node script needs to remove it (nodes), `paths` what goes with it (NAS)."""

    what: str  # composed dir, local file, revision, partial download, NAS
    where: str  # a node's name, or NAS
    path: str
    bytes: int
    remove: bool
    why: str
    item: dict[str, Any] | None = None
    paths: tuple[Path, ...] = ()


@dataclass(frozen=True)
class PruneRow:
    what: str
    where: str
    path: str
    bytes: int
    action: str  # removed, would remove, kept
    why: str

    def as_row(self) -> dict[str, str]:
        return {
            "what": self.what,
            "where": self.where,
            "path": self.path,
            "bytes": f"{human_bytes(self.bytes)} ({self.bytes})",
            "action": self.action,
            "why": self.why,
        }


@dataclass
class InUse:
    """What must stay, read from the recipes, the cluster's containers and its node locks."""

    # deployment id -> why it counts as in use
    deployments: dict[str, str] = field(default_factory=dict)
    # local file path -> the recipes naming it
    named_paths: dict[str, list[str]] = field(default_factory=dict)
    # node -> why none of its local files may go
    busy_nodes: dict[str, str] = field(default_factory=dict)
    # repo -> sha -> why that revision stays
    nas_keep: dict[str, dict[str, str]] = field(default_factory=dict)
    # repo -> why every revision of it stays
    nas_keep_repo: dict[str, str] = field(default_factory=dict)
    # why nothing on the NAS may go / no local file may go (None: no doubt)
    nas_doubt: str | None = None
    files_doubt: str | None = None

    def keep_revision(self, repo: str, sha: str, why: str) -> None:
        self.nas_keep.setdefault(repo, {}).setdefault(sha, why)


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


def resolved_sha(cache_dir: Path, ref: RepoRef) -> str | None:
    """The commit a recipe's revision means in the NAS cache: a pinned sha itself, else the one
    refs/<branch> names there (None: the repo is not in the cache at that branch)."""
    if ref.revision is not None and is_commit_sha(ref.revision):
        return ref.revision
    return read_ref(cache_dir, ref)


def recipes_in_use(recipes_dir: Path, cache_dir: Path, in_use: InUse) -> None:
    """Every recipe's local file paths and resolved revisions into in_use; a recipe that cannot
    be read makes every local file and the NAS a doubt (what it names is not known)."""
    problems = []
    for path in recipe_paths(recipes_dir):
        name = recipe_id_for(path)
        try:
            recipe = load_recipe(path)
            repos = recipe.hf_repos
        except RecipeError as error:
            problems.append(f"{name}: {str(error).splitlines()[0]}")
            continue
        for local in recipe.composed_model.local_files if recipe.composed_model else []:
            in_use.named_paths.setdefault(local.host, []).append(name)
        for ref in repos:
            sha = resolved_sha(cache_dir, ref)
            if sha is not None:
                at = f"@{ref.revision}" if ref.revision else " (main)"
                in_use.keep_revision(ref.repo, sha, f"recipe {name} names it ({ref.repo}{at})")
    if problems:
        doubt = f"recipe(s) cannot be read, so what they name is not known: {'; '.join(problems)}"
        in_use.files_doubt = in_use.nas_doubt = doubt


def deployments_in_use(
    cache_dir: Path, statuses: Sequence[DeploymentStatus], held: Holders, in_use: InUse
) -> None:
    """What runs (any container of ours, running or stopped) and what holds nodes, into in_use:
    their deployment ids, the revisions the running ones read, and the nodes held by one that
    has not booted."""
    for status in statuses:
        state = "runs" if any(c.status == "running" for c in status.containers) else "has"
        in_use.deployments[status.deployment_id] = (
            f"deployment {status.deployment_id} {state} containers on {', '.join(status.nodes)}"
        )
        if status.plan is None:
            in_use.nas_doubt = in_use.nas_doubt or (
                f"deployment {status.deployment_id} runs but cannot be planned again "
                f"({status.health}), so which revisions it reads is not known"
            )
            continue
        for ref in status.plan.repos:
            _running_revision(cache_dir, status, ref, in_use)
    for node, deployment_id in held.items():
        if deployment_id is None:
            continue
        in_use.deployments.setdefault(
            deployment_id, f"deployment {deployment_id} holds node {node}"
        )
        if not any(status.deployment_id == deployment_id for status in statuses):
            in_use.busy_nodes[node] = (
                f"node {node} is held by {deployment_id}, which has not booted: the files it"
                " stages are not known yet"
            )
            in_use.nas_doubt = in_use.nas_doubt or (
                f"deployment {deployment_id} holds node {node} and has not booted, so which"
                " revisions it reads is not known"
            )


def _running_revision(
    cache_dir: Path, status: DeploymentStatus, ref: RepoRef, in_use: InUse
) -> None:
    why = f"deployment {status.deployment_id} reads it"
    sha = resolved_sha(cache_dir, ref)
    if sha is not None:
        in_use.keep_revision(ref.repo, sha, why)
    if ref.revision is not None and is_commit_sha(ref.revision):
        return
    # By branch: the engine loaded what refs/<branch> named when it started; if the ref moved
    # since, the commit it loaded is not recorded anywhere, so every revision stays.
    ref_file = storage_dir(cache_dir, ref.repo) / "refs" / (ref.revision or "main")
    try:
        moved = ref_file.stat().st_mtime
        started = datetime.fromisoformat(status.since).timestamp()
    except (OSError, ValueError):
        moved, started = 1.0, 0.0
    if moved >= started:
        in_use.nas_keep_repo.setdefault(
            ref.repo,
            f"deployment {status.deployment_id} reads it by branch and its ref moved since the"
            " engine started: the commit it loaded is not known",
        )


# --- nodes ------------------------------------------------------------------------------------


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
            remove, why = False, f"composed {_hours(age)} ago, newer than {_hours(min_age_s)}"
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
    for entry in listing["files"]:
        if entry["exists"]:
            found.append(_decide_file(node, entry, going, in_use, now, min_age_s))
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
        why = f"changed {_hours(age)} ago, newer than {_hours(min_age_s)}"
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
    return build_node_script(node_prune, [node_hfcache, node_compose])


def call_node(runner: PythonRunner, node: str, request: Mapping[str, Any]) -> dict[str, Any]:
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


def node_rows(
    candidates: Sequence[Candidate], answer: Mapping[str, Any] | None, *, dry_run: bool
) -> list[PruneRow]:
    """The node's rows: what the removal answered (None: nothing was asked of the node)."""
    rows = []
    for c in candidates:
        if not c.remove:
            rows.append(PruneRow(c.what, c.where, c.path, c.bytes, KEPT, c.why))
        elif dry_run:
            rows.append(PruneRow(c.what, c.where, c.path, c.bytes, WOULD_REMOVE, c.why))
        elif answer is not None and c.path in answer["removed"]:
            rows.append(PruneRow(c.what, c.where, c.path, c.bytes, REMOVED, c.why))
        else:
            why = answer["kept"].get(c.path, "not removed") if answer else "not removed"
            rows.append(PruneRow(c.what, c.where, c.path, c.bytes, KEPT, why))
    return rows


# --- the NAS ----------------------------------------------------------------------------------


def _disk_bytes(path: Path) -> int:
    try:
        return node_prune.disk_bytes(path.lstat())
    except FileNotFoundError:
        return 0


def _tree(root: Path) -> Iterator[Path]:
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            yield Path(directory, name)


def _blobs_of(snapshot: Path, blobs: Path) -> set[str]:
    """The blobs a snapshot's symlinks point at."""
    found = set()
    for entry in _tree(snapshot):
        if entry.is_symlink():
            target = Path(os.path.normpath(entry.parent / os.readlink(entry)))
            if target.parent == blobs:
                found.add(target.name)
    return found


def decide_repo(
    storage: Path, repo: str, in_use: InUse, now: float, min_age_s: float
) -> list[Candidate]:
    """What of one repo's NAS cache dir may go, and why: revisions with the blobs only they
    link, partial downloads."""
    snapshots_dir, blobs = storage / "snapshots", storage / "blobs"
    snapshots = sorted(p for p in snapshots_dir.glob("*") if p.is_dir() and not p.is_symlink())
    refs = {
        ref: ref.read_text().strip()
        for ref in (_tree(storage / "refs") if (storage / "refs").is_dir() else [])
        if ref.is_file()
    }
    decided: list[tuple[Path, str | None]] = []
    for snapshot in snapshots:
        sha, age = snapshot.name, now - snapshot.stat().st_mtime
        why: str | None = in_use.nas_keep_repo.get(repo) or in_use.nas_keep.get(repo, {}).get(sha)
        if why is None and age < min_age_s:
            why = f"made {_hours(age)} ago, newer than {_hours(min_age_s)}"
        decided.append((snapshot, why))
    kept_blobs = set().union(*(_blobs_of(s, blobs) for s, why in decided if why is not None))
    claimed: set[str] = set()
    found = []
    for snapshot, why in decided:
        sha = snapshot.name
        if why is not None:
            found.append(Candidate("revision", NAS, str(snapshot), 0, False, why))
            continue
        linked = _blobs_of(snapshot, blobs)
        own = sorted(linked - kept_blobs - claimed)
        claimed.update(own)
        naming = sorted(str(ref.relative_to(storage)) for ref, to in refs.items() if to == sha)
        paths = (
            snapshot,
            *(blobs / blob for blob in own),
            storage / MANIFEST_DIRNAME / f"{sha}.json",
            storage / "trees" / f"{sha}.json",
            *(storage / ref for ref in naming),
        )
        size = sum(_disk_bytes(p) for p in paths[1:]) + sum(
            _disk_bytes(entry) for entry in [snapshot, *_tree(snapshot)]
        )
        shared = len(linked) - len(own)
        why = (
            f"{repo}: no recipe or running deployment names it; made"
            f" {_hours(now - snapshot.stat().st_mtime)} ago"
            + (f"; {shared} blob(s) linked by another revision stay" if shared else "")
            + (f"; {', '.join(naming)} named it" if naming else "")
        )
        found.append(Candidate("revision", NAS, str(snapshot), size, True, why, paths=paths))
    partial_age_s = PARTIAL_MIN_AGE_HOURS * 3600
    for partial in sorted(blobs.glob(f"*{PARTIAL_SUFFIX}")):
        age = now - partial.stat().st_mtime
        remove = age >= partial_age_s
        why = f"{repo}: partial download untouched for {_hours(age)}" + (
            "" if remove else f", less than {PARTIAL_MIN_AGE_HOURS} h: a prefetch may resume it"
        )
        found.append(
            Candidate(
                "partial download",
                NAS,
                str(partial),
                _disk_bytes(partial),
                remove,
                why,
                paths=(partial,),
            )
        )
    return found


def _remove_paths(paths: Sequence[Path]) -> None:
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _repo_name(storage: Path) -> str:
    """models--org--name -> org/name."""
    return storage.name.removeprefix("models--").replace("--", "/")


def prune_nas(
    cache_dir: Path, in_use: InUse, now: float, min_age_s: float, *, dry_run: bool, log: Log
) -> list[PruneRow]:
    """Every repo of the NAS cache decided; in a real run each repo's decision is made and
    carried out under its prefetch lock, and a repo whose lock a prefetch holds is left."""
    if in_use.nas_doubt is not None:
        return [PruneRow("NAS", NAS, str(cache_dir), 0, KEPT, in_use.nas_doubt)]
    rows: list[PruneRow] = []
    for storage in sorted(cache_dir.glob("models--*")):
        repo = _repo_name(storage)
        if dry_run:
            candidates = decide_repo(storage, repo, in_use, now, min_age_s)
            rows += [
                PruneRow(
                    c.what, c.where, c.path, c.bytes, WOULD_REMOVE if c.remove else KEPT, c.why
                )
                for c in candidates
            ]
            continue
        try:
            with repo_lock(storage, repo, wait_s=0, observer=SilentObserver()):
                candidates = decide_repo(storage, repo, in_use, now, min_age_s)
                for c in candidates:
                    if c.remove:
                        _remove_paths(c.paths)
                        log(f"NAS: removed {c.path} ({human_bytes(c.bytes)}): {c.why}")
                rows += [
                    PruneRow(c.what, c.where, c.path, c.bytes, REMOVED if c.remove else KEPT, c.why)
                    for c in candidates
                ]
        except PrefetchError as error:
            rows.append(PruneRow("repo", NAS, str(storage), 0, KEPT, f"{repo}: {error}"))
    return rows


# --- the whole prune --------------------------------------------------------------------------


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
        answers.update(_remove_on_nodes(cluster, decided, held, read_holders(), log))
    rows = [
        row for node in decided for row in node_rows(decided[node], answers[node], dry_run=dry_run)
    ]
    return rows + prune_nas(cache_dir, in_use, now, min_age_s, dry_run=dry_run, log=log)


def _remove_on_nodes(
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


def summary(rows: Sequence[PruneRow], *, dry_run: bool) -> str:
    """One line: what was (or would be) freed, and how much stays."""
    freed = [r for r in rows if r.action in (REMOVED, WOULD_REMOVE)]
    kept = [r for r in rows if r.action == KEPT]
    verb = "would free" if dry_run else "freed"
    return (
        f"prune {verb} {human_bytes(sum(r.bytes for r in freed))} in {len(freed)} item(s);"
        f" kept {len(kept)} item(s) ({human_bytes(sum(r.bytes for r in kept))})"
        + ("; dry run: run with dry_run=false to remove" if dry_run and freed else "")
    )
