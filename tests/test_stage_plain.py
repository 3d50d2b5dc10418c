"""Plain local files: put whole on a node from the NAS snapshot or the ops host, verified by
sha256, adopted when equal, never rewritten under other hard links.

The node script runs in a stdlib-only python3 (lab/testing/local_node.py), as over SSH.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import pytest
from lab_flows import nothing_runs, recipe_variant

from flows.deploy import deploy
from flows.teardown import teardown
from lab.testing.hfcache_layout import cache_files
from lab.testing.local_node import LocalNode
from sparkdeploy.errors import StagingError
from sparkdeploy.remote import ssh
from sparkdeploy.remote.targets import node_target
from sparkdeploy.spec.plan import PlainStage, Plan
from sparkdeploy.spec.project import load_plan
from sparkdeploy.spec.recipe import RepoRef
from sparkdeploy.steps import stage_plain as staging

ROOT = Path(__file__).parent.parent
REPO = "lab-org/TinyPlain"
COMMIT = "a" * 40
GENERATION_CONFIG = b'{"temperature": 0.6, "top_p": 0.95}\n'


def fake_nas(root: Path, files: dict[str, bytes]) -> Path:
    """An HF cache holding REPO@main: each file a symlink into blobs/, as the NAS holds it."""
    cache_files(root / "hf-cache", REPO, COMMIT, files)
    return root / "hf-cache"


def nas_stage(dest: Path, filename: str = "generation_config.json") -> PlainStage:
    return PlainStage(
        filename=filename, dest=str(dest), repo=RepoRef(repo=REPO), ops_file=None, sha256=None,
        size=None,
    )  # fmt: skip


def ops_stage(dest: Path, ops_file: Path, data: bytes | None = None) -> PlainStage:
    """A stage from the ops host; `data`: what the plan read (default: the file as it is)."""
    planned = ops_file.read_bytes() if data is None else data
    return PlainStage(
        filename=dest.name,
        dest=str(dest),
        repo=None,
        ops_file=str(ops_file),
        sha256=hashlib.sha256(planned).hexdigest(),
        size=len(planned),
    )


def stage(
    hf_cache: Path, stages: Sequence[PlainStage], runner: LocalNode | None = None, **kw: str
) -> list[str]:
    results = staging.stage_plain_on_node(
        runner or LocalNode(), "node-test", nas_hf_cache=str(hf_cache), stages=stages, **kw
    )
    return [result.status for result in results]


def sent_after_the_script(runner: LocalNode) -> list[bytes]:
    """What each node script got on its stdin after its own source."""
    script = staging.node_script().encode()
    return [ran.stdin.removeprefix(script) for ran in runner.ran]


def manifest(dest: Path) -> dict[str, object]:
    data = json.loads(Path(f"{dest}.manifest.json").read_text())
    assert isinstance(data, dict)
    return data


def test_copied_from_the_nas_snapshot_then_trusted_by_its_manifest(tmp_path: Path) -> None:
    hf_cache = fake_nas(tmp_path, {"generation_config.json": GENERATION_CONFIG})
    dest = tmp_path / "node" / "local" / "generation_config.json"
    assert stage(hf_cache, [nas_stage(dest)]) == ["copied"]
    assert dest.read_bytes() == GENERATION_CONFIG
    assert manifest(dest)["sha256"] == hashlib.sha256(GENERATION_CONFIG).hexdigest()
    assert not Path(f"{dest}.partial").exists()
    before = dest.stat()
    assert stage(hf_cache, [nas_stage(dest)]) == ["skipped"]
    after = dest.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_ops_host_bytes_are_sent_only_when_the_node_needs_them(tmp_path: Path) -> None:
    hf_cache = fake_nas(tmp_path, {})
    template = tmp_path / "recipe" / "chat_template.jinja"
    template.parent.mkdir()
    template.write_bytes(b"{{ messages }}\n")
    dest = tmp_path / "node" / "chat_template.jinja"
    runner = LocalNode()
    assert stage(hf_cache, [ops_stage(dest, template)], runner) == ["copied"]
    assert sent_after_the_script(runner) == [b"", b"{{ messages }}\n"]
    assert dest.read_bytes() == b"{{ messages }}\n"
    assert stage(hf_cache, [ops_stage(dest, template)], runner) == ["skipped"]
    assert sent_after_the_script(runner)[2:] == [b""]


def test_an_equal_file_with_two_links_is_adopted_untouched(tmp_path: Path) -> None:
    hf_cache = fake_nas(tmp_path, {"generation_config.json": GENERATION_CONFIG})
    dest = tmp_path / "node" / "generation_config.json"
    dest.parent.mkdir()
    dest.write_bytes(GENERATION_CONFIG)
    os.link(dest, tmp_path / "node" / "other-lane-link.json")
    before = dest.stat()
    assert stage(hf_cache, [nas_stage(dest)]) == ["adopted"]
    after = dest.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_nlink) == (
        before.st_ino,
        before.st_mtime_ns,
        2,
    )
    assert manifest(dest)["sha256"] == hashlib.sha256(GENERATION_CONFIG).hexdigest()
    assert stage(hf_cache, [nas_stage(dest)]) == ["skipped"]


def test_a_mismatching_file_with_other_links_is_refused_and_left_alone(tmp_path: Path) -> None:
    hf_cache = fake_nas(tmp_path, {"generation_config.json": GENERATION_CONFIG})
    dest = tmp_path / "node" / "generation_config.json"
    dest.parent.mkdir()
    dest.write_bytes(b'{"temperature": 1.0}\n')
    os.link(dest, tmp_path / "node" / "other-lane-link.json")
    with pytest.raises(StagingError, match=r"\[linked_mismatch\]") as refused:
        stage(hf_cache, [nas_stage(dest)])
    message = str(refused.value)
    assert "node node-test" in message
    assert str(dest) in message
    assert "has 2 hard links" in message
    assert "remove or rename" in message
    assert dest.read_bytes() == b'{"temperature": 1.0}\n'
    assert not Path(f"{dest}.manifest.json").exists()


def test_links_in_this_deployments_composed_dir_do_not_block_a_replacement(
    tmp_path: Path,
) -> None:
    hf_cache = fake_nas(tmp_path, {"generation_config.json": GENERATION_CONFIG})
    dest = tmp_path / "node" / "generation_config.json"
    dest.parent.mkdir()
    dest.write_bytes(b"old\n")
    composed = tmp_path / "composed" / "deployment"
    composed.mkdir(parents=True)
    os.link(dest, composed / "generation_config.json")
    statuses = stage(hf_cache, [nas_stage(dest)], composed_root=str(composed))
    assert statuses == ["copied"]
    assert dest.read_bytes() == GENERATION_CONFIG


def test_a_mismatching_file_with_one_link_is_replaced(tmp_path: Path) -> None:
    hf_cache = fake_nas(tmp_path, {"generation_config.json": GENERATION_CONFIG})
    dest = tmp_path / "node" / "generation_config.json"
    dest.parent.mkdir()
    dest.write_bytes(b'{"temperature": 1.0, "stale": true}\n')
    assert stage(hf_cache, [nas_stage(dest)]) == ["copied"]
    assert dest.read_bytes() == GENERATION_CONFIG


def test_bytes_that_do_not_hash_to_the_plans_sha256_are_never_put_in_place(
    tmp_path: Path,
) -> None:
    hf_cache = fake_nas(tmp_path, {})
    template = tmp_path / "chat_template.jinja"
    edited = b"{{ edited after the plan }}\n"
    template.write_bytes(edited)
    dest = tmp_path / "node" / "chat_template.jinja"
    # The same size, other bytes: only the sha256 tells them apart.
    planned = ops_stage(dest, template, data=edited.upper())
    with pytest.raises(StagingError, match=r"\[verify_failed\].*changed since the plan"):
        stage(hf_cache, [planned])
    assert not dest.exists()
    assert not Path(f"{dest}.partial").exists()


def test_a_file_missing_from_the_nas_snapshot_names_it_and_the_fix(tmp_path: Path) -> None:
    hf_cache = fake_nas(tmp_path, {})
    dest = tmp_path / "node" / "tokenizer.json"
    with pytest.raises(StagingError, match=r"\[missing_source\].*tokenizer\.json.*prefetch"):
        stage(hf_cache, [nas_stage(dest, "tokenizer.json")])


LAB_PLAIN_DEST = "/var/tmp/plain-local/tiny-dsv41/generation_config.json"
LAB_PATCHED = b'{"bos_token_id": 0, "eos_token_id": 1, "temperature": 0.7, "top_p": 0.9}\n'


def lab_plain_file_per_node(plan: Plan) -> dict[str, str]:
    """Per node, the plain file's inode and mtime, once checked to be hardlinked in the composed
    dir over the snapshot's entry with the patched content."""
    found = {}
    for node in plan.nodes:
        assert node.composed is not None
        with ssh.connect(node_target(node)) as connection:
            listed = connection.run(
                ["find", node.composed.root, "-name", "generation_config.json"], timeout=30
            )
            [entry] = listed.stdout.decode().split()
            stat = ["stat", "-c", "%i %y", LAB_PLAIN_DEST, entry]
            dest_stat, entry_stat = connection.run(stat, timeout=10).stdout.decode().splitlines()
            assert dest_stat == entry_stat, node.node
            assert connection.run(["cat", entry], timeout=10).stdout == LAB_PATCHED
            manifest = connection.run(["cat", f"{LAB_PLAIN_DEST}.manifest.json"], timeout=10)
            assert json.loads(manifest.stdout)["sha256"] == hashlib.sha256(LAB_PATCHED).hexdigest()
            found[node.node] = dest_stat
    return found


@pytest.mark.lab
@pytest.mark.usefixtures("prefect_harness")
def test_lab_deploy_links_an_ops_host_file_in_every_composed_dir_then_adopts_it(
    cluster: str, tmp_path: Path
) -> None:
    """lab-dsv41-3x with a patched generation_config.json from the ops host: on every node it
    is put whole and hardlinked in the composed dir over the snapshot's; a second deploy, the
    file's manifest gone, adopts the file in place (same inode and mtime: nothing written)."""
    first_engram = '[[composed_model.local_files]]\nhost = "/var/tmp/engram-local/'
    recipe = recipe_variant(
        tmp_path,
        "lab-dsv41-plain",
        ROOT / "recipes" / "lab-dsv41-3x" / "recipe.toml",
        (
            first_engram,
            f'[[composed_model.local_files]]\nhost = "{LAB_PLAIN_DEST}"\n'
            f'from_file = "patches/generation_config.json"\n\n{first_engram}',
        ),
    )
    (Path(recipe) / "patches").mkdir()
    (Path(recipe) / "patches" / "generation_config.json").write_bytes(LAB_PATCHED)
    plan = load_plan(recipe, cluster)
    assert [d.kind for d in plan.local_files] == ["plain", "engram", "engram"]
    try:
        deploy(recipe, cluster=cluster, skip=["smoke-test"])
        first = lab_plain_file_per_node(plan)
        teardown(cluster=cluster, recipe=recipe)
        for node in plan.nodes:
            with ssh.connect(node_target(node)) as connection:
                connection.run(["rm", f"{LAB_PLAIN_DEST}.manifest.json"], timeout=10)
        deploy(recipe, cluster=cluster, skip=["smoke-test"])
        assert lab_plain_file_per_node(plan) == first
    finally:
        teardown(cluster=cluster, recipe=recipe)
        for node in plan.nodes:
            with ssh.connect(node_target(node)) as connection:
                connection.run(["rm", "-rf", "/var/tmp/plain-local"], timeout=30)
    nothing_runs(cluster)
