"""What must stay, read before anything is decided: the local files and resolved revisions
the recipes name, the deployments that run or hold nodes and the revisions they read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from sparkdeploy.errors import RecipeError
from sparkdeploy.spec.recipe import RepoRef
from sparkdeploy.spec.recipe_loading import load_recipe, recipe_id_for, recipe_paths
from sparkdeploy.steps.prefetch.cache import read_ref, storage_dir
from sparkdeploy.steps.prefetch.names import is_commit_sha
from sparkdeploy.steps.status import DeploymentStatus

# node -> the deployment holding it (None: free), as the node lock records say
Holders = Mapping[str, str | None]


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
