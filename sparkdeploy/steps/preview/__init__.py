"""A preview: what a deploy of a plan would do now, per step and node, read without changing
anything (`sparkdeploy plan --live`, the `preview` flow).

Each step is read as the deploy's own step reads it, and nothing is written: the NAS cache
through sparkdeploy.steps.prefetch.preview (no lock taken, no ref or manifest written; the hub
only asked for listings), the node locks from the Prefect server (none taken), each node's
image and containers by a read-only probe and `docker ps`/`inspect`, its Engram copies by the
staging script's dry run (`"dry_run": true`), which writes nothing either. A deploy right after
a preview does what the preview says (tests/test_preview_lab.py compares them), with two
things a preview cannot know in advance: a file in the NAS whose hash turns out wrong is
fetched again, and a hand-made Engram copy whose compare finds a difference is copied anew.

Expected times come from the bytes and the inventory's rates ([hub] download_gb_per_s, [nas]
read_gb_per_s, [docker] pull_gb_per_s, a node's disk_gb_per_s: docs/inventory.md), else from
stated defaults (model.py), and each row says which.

One module per job:
  __init__.py   preview(): the steps in the deploy's order
  model.py      Row, Preview (its markdown and JSON), the rates
  locks.py      hold-nodes: who holds each node, and what the deploy would do about it
  nodes.py      each node's docker, image and containers (one read-only look); boot
  image.py      the image step on each node, from the looks
  staging.py    stage-engram (the staging script's dry run) and compose-model
"""

from __future__ import annotations

from pathlib import Path

from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.spec.cluster import Cluster
from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.prefetch import HubAccess
from sparkdeploy.steps.prefetch.preview import RepoAction, RepoPreview, preview_repos
from sparkdeploy.steps.prefetch.selection import FileSelection
from sparkdeploy.steps.preview.image import image_rows
from sparkdeploy.steps.preview.locks import hold_rows
from sparkdeploy.steps.preview.model import (
    FLOW_HOST,
    STEPS,
    Action,
    Preview,
    Rates,
    Row,
    timed,
)
from sparkdeploy.steps.preview.nodes import boot_rows, look
from sparkdeploy.steps.preview.staging import compose_rows, engram_rows

__all__ = ["STEPS", "Preview", "Row", "preview"]


def preview(
    plan: Plan,
    cluster: Cluster,
    hub: HubAccess,
    *,
    replace: bool = False,
    update_revisions: bool = False,
    lock_timeout_s: float = 600.0,
) -> Preview:
    """What `deploy` (with these parameters) would do now; reads only (module docstring).
    `cluster` is the plan's inventory: its rates time the rows."""
    rates = Rates.of(cluster)
    targets = plan_targets(plan)
    repos = preview_repos(
        plan.repos,
        Path(plan.nas_hf_cache),
        hub,
        update_revisions=update_revisions,
        selection=FileSelection(tuple(plan.prefetch_include), tuple(plan.prefetch_exclude)),
    )
    prefetch = [_repo_row(repo, rates) for repo in repos]
    hold, held = hold_rows(plan, targets, replace=replace, lock_timeout_s=lock_timeout_s)
    looks = look(targets, plan.docker_image)
    engram = engram_rows(plan, targets, rates)
    rows = [
        *prefetch,
        *hold,
        *engram,
        *image_rows(plan, looks, rates),
        *compose_rows(plan, engram),
        *boot_rows(plan, looks, held, replace=replace),
    ]
    return Preview(
        deployment_id=plan.deployment_id,
        recipe=plan.recipe,
        cluster=plan.cluster,
        nodes=tuple(node.node for node in plan.nodes),
        options={"replace": replace, "update_revisions": update_revisions},
        rows=tuple(rows),
    )


def _repo_row(repo: RepoPreview, rates: Rates) -> Row:
    """A repo's row: its bytes are those it would fetch (or, adopted, hash), timed at the hub's
    download rate and the NAS's read rate."""
    subject = f"{repo.repo}@{repo.revision or 'main'}"
    if repo.sha is not None:
        subject += f" ({repo.sha[:12]})"
    actions: dict[RepoAction, Action] = {
        "complete": "none",
        "adopt": "adopt",
        "download": "download",
        "unknown": "unknown",
        "refuse": "refuse",
    }
    # A repo refused or unknown before its files were listed has no bytes to show.
    shown = repo.download_bytes or repo.hash_bytes or (None if repo.total_bytes is None else 0)
    row = Row("prefetch", FLOW_HOST, subject, actions[repo.action], shown, repo.detail)
    if repo.hash_bytes:
        row = timed(row, repo.hash_bytes, rates.nas_read)
    if repo.download_bytes and repo.action == "download":
        row = timed(row, repo.download_bytes, rates.download)
    return row
