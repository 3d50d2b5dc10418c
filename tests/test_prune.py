"""The prune's decisions on tmp dirs: a node's composed dirs and local files (listed by the node
script as a node runs it) and the NAS HF cache's revisions and partial downloads."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab.testing.local_node import LocalNode
from sparkdeploy.node import compose_model, engram_plan, staged_file
from sparkdeploy.node import prune as node_prune
from sparkdeploy.spec.recipe import RepoRef
from sparkdeploy.steps.prune.in_use import (
    InUse,
    deployments_in_use,
    recipes_in_use,
    resolved_sha,
)
from sparkdeploy.steps.prune.nas import decide_repo, prune_nas
from sparkdeploy.steps.prune.nodes import call_node, decide_node
from sparkdeploy.steps.prune.rows import KEPT, NAS, REMOVED, WOULD_REMOVE, Candidate
from sparkdeploy.steps.teardown import left_on_nodes

NOW = time.time()
WEEK_S = 7 * 24 * 3600.0
OLD = NOW - 30 * 24 * 3600
COMMIT = "c" * 40


def age(path: Path, mtime: float = OLD) -> None:
    os.utime(path, (mtime, mtime), follow_symlinks=False)


def local_file(path: Path, *, manifest: bool = True, mtime: float = OLD) -> Path:
    """A sparse local file (an Engram copy's shape) with our manifest beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.seek(1 << 20)
        f.write(b"rows" * 1024)
    if manifest:
        Path(f"{path}{node_prune.MANIFEST_SUFFIX}").write_text("{}")
    age(path, mtime)
    return path


def composed_dir(root: Path, deployment: str, local_files: list[Path], mtime: float = OLD) -> Path:
    """A composed dir as compose_model leaves it: its key, each local file hardlinked in."""
    directory = root / deployment
    snapshot = directory / "models--lab--tiny" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    key = {
        "local_files": [{"path": str(path)} for path in local_files],
        "sources": [{"repo": "lab/tiny", "commit": COMMIT}],
    }
    (directory / compose_model.KEY_FILE).write_text(
        f"{compose_model.CACHEDIR_SIGNATURE}\n{compose_model.KEY_LINE_PREFIX}{json.dumps(key)}\n"
    )
    for path in local_files:
        os.link(path, snapshot / path.name)
    age(directory, mtime)
    return directory


def decisions(candidates: list[Candidate]) -> dict[str, tuple[bool, str]]:
    return {c.path: (c.remove, c.why) for c in candidates}


def listing(root: Path, named: Sequence[Path] = ()) -> dict[str, Any]:
    """The node script's listing, run as on a node (stdlib-only python3)."""
    return call_node(
        LocalNode(),
        "node1",
        {"action": "list", "composed_root": str(root), "local_files": [str(p) for p in named]},
    )


def test_the_companion_names_are_the_staging_scripts() -> None:
    assert node_prune.MANIFEST_SUFFIX == staged_file.MANIFEST_SUFFIX
    assert staged_file.PARTIAL_SUFFIX in node_prune.COMPANION_SUFFIXES
    assert engram_plan.JOURNAL_SUFFIX in node_prune.COMPANION_SUFFIXES


def test_a_gone_deployments_dir_and_copy_are_removed_with_the_manifest(tmp_path: Path) -> None:
    root = tmp_path / "composed"
    copy = local_file(tmp_path / "engram" / "shard.safetensors")
    gone = composed_dir(root, "lab-gone-00000001", [copy])
    found = decide_node("node1", listing(root), InUse(), NOW, WEEK_S)
    assert decisions(found) == {
        str(gone): (True, "deployment lab-gone-00000001 neither runs nor holds a node"),
        str(copy): (
            True,
            "no recipe names it and no deployment that stays uses it (linked only by"
            " lab-gone-00000001, going too)",
        ),
    }
    # Sparse: the bytes on disk, not the file's size.
    assert next(c for c in found if c.path == str(copy)).bytes < 1 << 20
    items = [c.item for c in found if c.remove]
    answer = call_node(
        LocalNode(), "node1", {"action": "remove", "composed_root": str(root), "items": items}
    )
    assert sorted(answer["removed"]) == sorted([str(gone), str(copy)])
    assert not gone.exists()
    assert not copy.exists()
    assert not Path(f"{copy}{node_prune.MANIFEST_SUFFIX}").exists()


def test_a_copy_another_lane_hardlinks_is_kept_and_says_so(tmp_path: Path) -> None:
    root = tmp_path / "composed"
    copy = local_file(tmp_path / "engram" / "shard.safetensors")
    os.link(copy, tmp_path / "other-lane.safetensors")
    composed_dir(root, "lab-gone-00000001", [copy])
    found = decisions(decide_node("node1", listing(root), InUse(), NOW, WEEK_S))
    assert found[str(copy)] == (
        False,
        "1 hard link(s) outside node1's composed dirs: another lane holds it",
    )


def test_a_link_made_after_the_listing_keeps_the_copy(tmp_path: Path) -> None:
    root = tmp_path / "composed"
    copy = local_file(tmp_path / "engram" / "shard.safetensors")
    found = decide_node("node1", listing(root, [copy]), InUse(), NOW, WEEK_S)
    assert decisions(found)[str(copy)][0]
    os.link(copy, tmp_path / "late-lane.safetensors")
    answer = call_node(
        LocalNode(),
        "node1",
        {"action": "remove", "composed_root": str(root), "items": [found[0].item]},
    )
    assert answer == {
        "ok": True,
        "removed": [],
        "kept": {str(copy): "1 other hard link(s) to it now: another lane holds it"},
    }
    assert copy.exists()


def test_what_is_newer_than_the_age_is_kept(tmp_path: Path) -> None:
    root = tmp_path / "composed"
    copy = local_file(tmp_path / "engram" / "shard.safetensors", mtime=NOW - 3600)
    fresh = composed_dir(root, "lab-fresh-00000001", [copy], mtime=NOW - 3600)
    found = decisions(decide_node("node1", listing(root), InUse(), NOW, WEEK_S))
    assert found[str(fresh)] == (False, "composed 1.0 h ago, newer than 168.0 h")
    assert found[str(copy)] == (
        False,
        "the composed dir of lab-fresh-00000001, which stays, links it",
    )
    alone = local_file(tmp_path / "alone" / "shard.safetensors", mtime=NOW - 3600)
    found = decisions(decide_node("node1", listing(root, [alone]), InUse(), NOW, WEEK_S))
    assert found[str(alone)] == (False, "changed 1.0 h ago, newer than 168.0 h")


def test_a_copy_a_recipe_names_is_kept(tmp_path: Path) -> None:
    root = tmp_path / "composed"
    copy = local_file(tmp_path / "engram" / "shard.safetensors")
    composed_dir(root, "lab-gone-00000001", [copy])
    in_use = InUse(named_paths={str(copy): ["lab-dsv41-3x"]})
    found = decisions(decide_node("node1", listing(root), in_use, NOW, WEEK_S))
    assert found[str(copy)] == (False, "recipe lab-dsv41-3x names it")


def test_a_held_deployments_dir_and_copies_are_kept(tmp_path: Path) -> None:
    root = tmp_path / "composed"
    copy = local_file(tmp_path / "engram" / "shard.safetensors")
    held = composed_dir(root, "lab-held-00000001", [copy])
    in_use = InUse()
    deployments_in_use(tmp_path / "nas", [], {"node1": "lab-held-00000001"}, in_use)
    found = decisions(decide_node("node1", listing(root), in_use, NOW, WEEK_S))
    assert found[str(held)] == (False, "deployment lab-held-00000001 holds node node1")
    assert not found[str(copy)][0]
    # Held before its boot: what it reads on the NAS is not known, so the NAS is left alone.
    assert in_use.nas_doubt is not None
    assert "lab-held-00000001" in in_use.nas_doubt


def test_a_file_without_our_manifest_and_a_dir_without_our_key_are_kept(tmp_path: Path) -> None:
    root = tmp_path / "composed"
    by_hand = local_file(tmp_path / "engram" / "shard.safetensors", manifest=False)
    foreign = root / "someone-elses"
    foreign.mkdir(parents=True)
    age(foreign)
    found = decisions(decide_node("node1", listing(root, [by_hand]), InUse(), NOW, WEEK_S))
    assert found[str(foreign)] == (False, "no sparkdeploy key (CACHEDIR.TAG) in it: not ours")
    assert found[str(by_hand)] == (False, "no .manifest.json beside it: not a copy of ours")


def nas_repo(cache: Path, repo: str) -> Path:
    storage = cache / ("models--" + repo.replace("/", "--"))
    for sub in ("blobs", "snapshots", "refs", ".sparkdeploy"):
        (storage / sub).mkdir(parents=True, exist_ok=True)
    return storage


def snapshot(storage: Path, sha: str, blobs: dict[str, bytes], mtime: float = OLD) -> Path:
    """snapshots/<sha>/<name> -> ../../blobs/<blob>, with our manifest for the commit."""
    directory = storage / "snapshots" / sha
    directory.mkdir()
    for name, data in blobs.items():
        blob = storage / "blobs" / name
        blob.write_bytes(data)
        (directory / f"{name}.bin").symlink_to(os.path.relpath(blob, directory))
    (storage / ".sparkdeploy" / f"{sha}.json").write_text("{}")
    age(directory, mtime)
    return directory


def test_a_revision_no_recipe_names_goes_but_a_blob_another_revision_links_stays(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "hf-cache"
    storage = nas_repo(cache, "lab/tiny")
    old_sha, new_sha = "a" * 40, "b" * 40
    old = snapshot(storage, old_sha, {"shared": b"s" * 5000, "only-old": b"o" * 9000})
    new = snapshot(storage, new_sha, {"shared": b"s" * 5000, "only-new": b"n" * 100})
    (storage / "refs" / "main").write_text(new_sha)
    in_use = InUse()
    recipes_in_use(tmp_path / "no-recipes", cache, in_use)
    sha = resolved_sha(cache, RepoRef(repo="lab/tiny"))
    assert sha == new_sha
    in_use.keep_revision("lab/tiny", sha, "recipe lab-tiny names it (lab/tiny (main))")
    found = decisions(decide_repo(storage, "lab/tiny", in_use, NOW, WEEK_S))
    assert found[str(new)] == (False, "recipe lab-tiny names it (lab/tiny (main))")
    assert found[str(old)][0]
    assert "1 blob(s) linked by another revision stay" in found[str(old)][1]

    rows = prune_nas(cache, in_use, NOW, WEEK_S, dry_run=False, log=lambda line: None)
    assert {(r.path, r.action) for r in rows} == {(str(old), REMOVED), (str(new), KEPT)}
    assert not old.exists()
    assert not (storage / "blobs" / "only-old").exists()
    assert not (storage / ".sparkdeploy" / f"{old_sha}.json").exists()
    assert (storage / "blobs" / "shared").exists()
    assert (new / "shared.bin").read_bytes()


def test_a_recent_revision_and_a_recent_partial_stay_an_old_partial_goes(tmp_path: Path) -> None:
    cache = tmp_path / "hf-cache"
    storage = nas_repo(cache, "lab/tiny")
    recent = snapshot(storage, "d" * 40, {"x": b"x"}, mtime=NOW - 3600)
    stale = storage / "blobs" / "dead.incomplete"
    stale.write_bytes(b"p" * 4096)
    age(stale, NOW - 2 * 24 * 3600)
    live = storage / "blobs" / "live.incomplete"
    live.write_bytes(b"p")
    rows = prune_nas(cache, InUse(), NOW, WEEK_S, dry_run=True, log=lambda line: None)
    assert {r.path: r.action for r in rows} == {
        str(recent): KEPT,
        str(stale): WOULD_REMOVE,
        str(live): KEPT,
    }
    assert stale.exists()  # a dry run


def test_a_doubt_leaves_the_nas_alone(tmp_path: Path) -> None:
    in_use = InUse(nas_doubt="deployment x runs but cannot be planned again")
    rows = prune_nas(tmp_path, in_use, NOW, 0, dry_run=False, log=lambda line: None)
    assert [(r.where, r.action, r.why) for r in rows] == [
        (NAS, KEPT, "deployment x runs but cannot be planned again")
    ]


def test_teardown_says_what_it_left_and_how_to_prune_it() -> None:
    line = left_on_nodes(
        "lab", ["node1"], "/var/tmp/sparkdeploy/composed/lab-x-1", ["/var/tmp/e/a.safetensors"]
    )
    assert line.startswith(
        "left on node1: the composed dir /var/tmp/sparkdeploy/composed/lab-x-1 and the local"
        " files /var/tmp/e/a.safetensors"
    )
    assert "prefect deployment run 'prune/nightly' -p cluster=lab -p dry_run=false" in line
    assert left_on_nodes("lab", ["node1"], None, []).startswith("nothing of it is left")
