"""The prune flow on the lab: what three deploys and teardowns left on the nodes is listed by a
dry run, removed by a real run, and nothing a running deployment or a recipe uses is touched."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from lab_flows import LAB_DSV41_RECIPE, ask, nothing_runs, recipe_variant

from flows.deploy import deploy
from flows.prune import prune
from flows.teardown import teardown
from lab.prefect_local import PROJECT_ROOT
from sparkdeploy.node.hfcache import SnapshotNotFound, resolve_snapshot
from sparkdeploy.remote import ssh
from sparkdeploy.remote.targets import node_target
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import Plan
from sparkdeploy.spec.project import load_plan
from sparkdeploy.spec.recipe_loading import load_all_recipes
from sparkdeploy.steps.prune.rows import KEPT, NAS, REMOVED, WOULD_REMOVE

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]

ENGRAM_LOCAL = 'host = "/var/tmp/engram-local/'


def variant_at(tmp_path: Path, name: str, local_dir: str) -> str:
    """lab-dsv41-3x with both Engram copies under local_dir: a path no recipe names."""
    return recipe_variant(
        tmp_path,
        name,
        LAB_DSV41_RECIPE,
        (ENGRAM_LOCAL, f'host = "{local_dir}/'),
        (ENGRAM_LOCAL, f'host = "{local_dir}/'),
    )


def left_by(plan: Plan) -> set[tuple[str, str]]:
    """(node, path) of what a teardown of the plan leaves: composed dir and local files."""
    assert plan.head.composed is not None
    return {
        (node.node, path)
        for node in plan.nodes
        if node.composed is not None
        for path in (node.composed.root, *node.composed.local_files)
    }


def present(plan: Plan, paths: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """Which of (node, path) exist on the plan's nodes."""
    found = set()
    for node in plan.nodes:
        with ssh.connect(node_target(node)) as connection:
            for where, path in paths:
                if where == node.node:
                    result = connection.run(["test", "-e", path], timeout=10, check=False)
                    if result.exit_code == 0:
                        found.add((where, path))
    return found


def recipe_snapshots(cluster: str) -> set[Path]:
    """The snapshot dirs the recipes' repos resolve to in the NAS: what a deploy reads."""
    nas = load_cluster(Path(cluster)).nas.hf_cache
    found = set()
    for recipe in load_all_recipes(PROJECT_ROOT / "recipes").values():
        for ref in recipe.hf_repos:
            with contextlib.suppress(SnapshotNotFound):
                found.add(Path(resolve_snapshot(nas, ref.repo, ref.revision)[1]))
    return found


def test_prune_frees_what_teardowns_left_and_nothing_a_running_deployment_uses(
    cluster: str, tmp_path: Path
) -> None:
    """Two variants of lab-dsv41-3x (Engram copies at paths no recipe names) and lab-single are
    deployed and torn down; lab-dsv41-3x then runs. The dry run lists the variants' composed
    dirs and copies on every node as to be removed, with their bytes; the real run removes
    exactly those; lab-dsv41-3x's composed dir and copies stay and it still answers; the NAS
    keeps every revision of a repo a recipe names."""
    variant_a = variant_at(tmp_path, "lab-prune-a", "/var/tmp/engram-prune-a")
    variant_b = variant_at(tmp_path, "lab-prune-b", "/var/tmp/engram-prune-b")
    plans = {recipe: load_plan(recipe, cluster) for recipe in (variant_a, variant_b)}
    running = load_plan("lab-dsv41-3x", cluster)
    try:
        for recipe in (variant_a, variant_b, "lab-single"):
            deploy(recipe, cluster=cluster, skip=["smoke-test"])
            teardown(cluster=cluster, recipe=recipe)
        deploy("lab-dsv41-3x", cluster=cluster, skip=["smoke-test"])
        left = left_by(plans[variant_a]) | left_by(plans[variant_b])
        assert present(running, left) == left
        in_use = left_by(running)

        dry = prune(cluster, min_age_hours=0)
        would = {(r.where, r.path) for r in dry if r.action == WOULD_REMOVE}
        assert left <= would, sorted(left - would)
        assert not would & in_use
        assert all(r.bytes > 0 for r in dry if (r.where, r.path) in left and "engram" in r.path)
        # Other tests of the session leave repos and revisions no recipe names (lab/fault-chat,
        # a branch's older commit): those may go; a revision a recipe resolves to never does.
        named = recipe_snapshots(cluster)
        assert named
        assert not [r for r in dry if r.where == NAS and r.action != KEPT and Path(r.path) in named]
        assert present(running, left) == left  # a dry run removes nothing

        done = prune(cluster, dry_run=False, min_age_hours=0)
        removed = {(r.where, r.path) for r in done if r.action == REMOVED}
        assert removed == would
        assert present(running, left) == set()
        assert present(running, in_use) == in_use
        assert all(snapshot.is_dir() for snapshot in named)
        kept = {(r.where, r.path) for r in done if r.action == KEPT and r.where != NAS}
        assert in_use <= kept
        assert ask(running.endpoint, running.served_model_name, "Say hello.")
    finally:
        teardown(cluster=cluster, recipe="lab-dsv41-3x")
        for recipe in (variant_a, variant_b, "lab-single"):
            teardown(cluster=cluster, recipe=recipe)
        for node in running.nodes:
            with ssh.connect(node_target(node)) as connection:
                connection.run(
                    ["rm", "-rf", "/var/tmp/engram-prune-a", "/var/tmp/engram-prune-b"], timeout=30
                )
    nothing_runs(cluster)
