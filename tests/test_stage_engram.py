"""Engram sparse-copy staging, run through the node script in a stdlib-only python3.

Each test stages a lab.tinymodel Engram shard from an HF cache laid out as the NAS holds it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from lab.cluster import Lab
from lab.testing.hfcache_layout import cache_repo, commit_of
from lab.testing.local_node import LocalNode
from lab.tinymodel import EngramSpec, generate_repo
from sparkdeploy.errors import StagingError
from sparkdeploy.node.engram import read_safetensors_header
from sparkdeploy.node.engram_copy import StagingResult
from sparkdeploy.remote import ssh
from sparkdeploy.spec.plan import ComposedPlan, EngramStage
from sparkdeploy.spec.recipe import RepoRef
from sparkdeploy.steps import compose_model as compose
from sparkdeploy.steps import stage_engram as staging

REPO = "lab-org/TinyEngram"
TP = 3
CHUNK = 64 * 1024
SYNC = 4 * CHUNK
# 6 columns per layer, so each of 3 ranks owns 2; tables of about 1.5 MiB each.
SPEC = EngramSpec.for_table_bytes(3 * 512 * 1024, n_heads=3)


@dataclass
class Nas:
    hf_cache: Path
    repos: Path
    snapshot: Path
    filename: str
    all_shards: list[str]


def make_nas(root: Path, revision: str = "1", spec: EngramSpec = SPEC) -> Nas:
    repo = generate_repo(
        root / f"repos-{revision}", REPO, revision=revision, engram=spec, tp_size=TP
    )
    snapshot = cache_repo(repo, root / "hf-cache", revision=revision)
    return Nas(
        root / "hf-cache",
        root / f"repos-{revision}",
        snapshot,
        repo.engram_shards[1],
        sorted(repo.engram_shards.values()),
    )


@pytest.fixture
def nas(tmp_path: Path) -> Nas:
    return make_nas(tmp_path)


def engram_stage(repo: str, filename: str, dest: Path | str, ranks: list[int]) -> EngramStage:
    return EngramStage(
        repo=RepoRef(repo=repo), filename=filename, dest=str(dest), ranks=ranks, tp_size=TP
    )


def stage(
    nas: Nas,
    dest: Path,
    ranks: list[int],
    *,
    stop_after_chunks: int | None = None,
    on_progress: Callable[[str, str, int, int, str], None] | None = None,
    composed_root: Path | None = None,
) -> StagingResult:
    (result,) = staging.stage_on_node(
        LocalNode(),
        "node-test",
        nas_hf_cache=str(nas.hf_cache),
        stages=[engram_stage(REPO, nas.filename, dest, ranks)],
        composed_root=None if composed_root is None else str(composed_root),
        chunk_bytes=CHUNK,
        sync_bytes=SYNC,
        stop_after_chunks=stop_after_chunks,
        on_progress=on_progress,
    )
    return result


def assert_sparse_copy_of(source: Path, dest: Path, ranges: tuple[tuple[int, int], ...]) -> None:
    """dest = source inside the ranges, zeros (holes) everywhere else."""
    data, copy = source.read_bytes(), dest.read_bytes()
    assert len(copy) == len(data)
    position = 0
    for begin, end in ranges:
        assert copy[position:begin].count(0) == begin - position
        assert copy[begin:end] == data[begin:end]
        position = end
    assert copy[position:].count(0) == len(copy) - position


def test_each_rank_gets_header_and_its_rows_at_their_offsets(nas: Nas, tmp_path: Path) -> None:
    source = nas.snapshot / nas.filename
    header_len, tensors, _ = read_safetensors_header(source)
    shares = []
    for rank in range(TP):
        dest = tmp_path / f"node{rank}" / nas.filename
        result = stage(nas, dest, [rank])
        assert result.status == "copied"
        assert result.ranges[0][0] == 0
        assert result.ranges[0][1] >= 8 + header_len
        assert_sparse_copy_of(source, dest, result.ranges)
        assert result.copied_bytes == result.share_bytes + result.header_bytes
        # Holes everywhere else: at most one partial block at each end of each range.
        blocks = len(result.ranges) * 2 * os.stat(dest).st_blksize
        assert result.allocated_bytes <= result.share_bytes + result.header_bytes + blocks
        assert result.holes_checked
        manifest = json.loads(Path(f"{dest}.manifest.json").read_text())
        assert manifest["ranks"] == [rank]
        assert manifest["tp_size"] == TP
        assert manifest["source"]["commit"] == commit_of(REPO, "1")
        assert manifest["range_sha256"] == list(result.range_sha256)
        assert {row["layer_id"] for row in manifest["rows"]} == {1}
        shares.append(result.share_bytes)
    weight, scale = tensors["layers.1.engram.embed.weight"], tensors["layers.1.engram.embed.scale"]
    assert sum(shares) == (weight.end - weight.begin) + (scale.end - scale.begin)


def test_rerun_is_skipped_without_touching_the_copy(nas: Nas, tmp_path: Path) -> None:
    dest = tmp_path / "node" / nas.filename
    stage(nas, dest, [1])
    manifest = Path(f"{dest}.manifest.json")
    before = (os.stat(dest).st_mtime_ns, os.stat(dest).st_ino, manifest.stat().st_mtime_ns)
    result = stage(nas, dest, [1])
    assert result.status == "skipped"
    assert result.copied_bytes == 0
    assert (os.stat(dest).st_mtime_ns, os.stat(dest).st_ino, manifest.stat().st_mtime_ns) == before


def test_another_rank_rebuilds(nas: Nas, tmp_path: Path) -> None:
    dest = tmp_path / "node" / nas.filename
    first = stage(nas, dest, [0])
    result = stage(nas, dest, [2])
    assert result.status == "copied"
    assert result.ranges != first.ranges
    assert_sparse_copy_of(nas.snapshot / nas.filename, dest, result.ranges)
    assert json.loads(Path(f"{dest}.manifest.json").read_text())["ranks"] == [2]


def test_another_source_revision_rebuilds(nas: Nas, tmp_path: Path) -> None:
    dest = tmp_path / "node" / nas.filename
    stage(nas, dest, [1])
    newer = make_nas(tmp_path, revision="2")
    result = stage(newer, dest, [1])
    assert result.status == "copied"
    assert_sparse_copy_of(newer.snapshot / newer.filename, dest, result.ranges)
    manifest = json.loads(Path(f"{dest}.manifest.json").read_text())
    assert manifest["source"]["commit"] == commit_of(REPO, "2")


def test_interrupted_copy_resumes_where_it_stopped(nas: Nas, tmp_path: Path) -> None:
    dest = tmp_path / "node" / nas.filename
    with pytest.raises(StagingError, match=r"\[interrupted\]"):
        stage(nas, dest, [1], stop_after_chunks=3)
    assert not dest.exists()
    journal = json.loads(Path(f"{dest}.partial.journal.json").read_text())
    durable = journal["copied_through"]
    assert durable > 0
    result = stage(nas, dest, [1])
    assert result.status == "resumed"
    assert result.copied_bytes == result.share_bytes + result.header_bytes - durable
    assert_sparse_copy_of(nas.snapshot / nas.filename, dest, result.ranges)
    assert not Path(f"{dest}.partial.journal.json").exists()
    assert not Path(f"{dest}.partial").exists()


def test_killed_copy_resumes(tmp_path: Path) -> None:
    nas = make_nas(tmp_path, spec=EngramSpec.for_table_bytes(24 * 1024 * 1024, n_heads=3))
    dest = tmp_path / "node" / nas.filename
    request = staging.node_request(
        "node-test",
        nas_hf_cache=str(nas.hf_cache),
        stages=[engram_stage(REPO, nas.filename, dest, [0])],
        chunk_bytes=16 * 1024,
        sync_bytes=64 * 1024,
    )
    journal = Path(f"{dest}.partial.journal.json")
    process = subprocess.Popen(
        staging.node_argv(request), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60
        while not journal.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
    assert process.returncode == -signal.SIGKILL, "the copy finished before it could be killed"
    durable = json.loads(journal.read_text())["copied_through"]
    result = stage(nas, dest, [0])
    assert result.status == "resumed"
    assert result.copied_bytes == result.share_bytes + result.header_bytes - durable
    assert_sparse_copy_of(nas.snapshot / nas.filename, dest, result.ranges)


def test_missing_source_names_the_path_and_the_fix(nas: Nas, tmp_path: Path) -> None:
    (nas.snapshot / nas.filename).unlink()
    with pytest.raises(StagingError, match=r"\[missing_source\]") as raised:
        stage(nas, tmp_path / "node" / nas.filename, [0])
    assert "node-test" in str(raised.value)
    assert str(nas.snapshot / nas.filename) in str(raised.value)
    assert "prefetch" in str(raised.value)


def test_repo_not_in_cache_names_the_ref(nas: Nas, tmp_path: Path) -> None:
    (nas.snapshot.parent.parent / "refs" / "main").unlink()
    with pytest.raises(StagingError, match=r"refs/main does not exist.*prefetch"):
        stage(nas, tmp_path / "node" / nas.filename, [0])


def test_geometry_mismatch_names_the_tensor(nas: Nas, tmp_path: Path) -> None:
    config_path = nas.snapshot / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"]["engram_head_dim"] *= 2
    config_path.unlink()  # a symlink into the blobs: replace it, do not write through it
    config_path.write_text(json.dumps(config))
    with pytest.raises(StagingError, match=r"\[geometry\].*layers\.1\.engram\.embed\.weight"):
        stage(nas, tmp_path / "node" / nas.filename, [0])


def test_bad_header_names_the_file(nas: Nas, tmp_path: Path) -> None:
    blob = (nas.snapshot / nas.filename).resolve()
    with open(blob, "r+b") as shard:
        shard.write((2**40).to_bytes(8, "little"))
    with pytest.raises(StagingError, match=r"\[bad_header\].*" + nas.filename):
        stage(nas, tmp_path / "node" / nas.filename, [0])


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs")
def test_no_space_says_how_much_is_needed(nas: Nas, tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], check=True)
    try:
        with pytest.raises(StagingError, match=r"\[no_space\].* GB free .* needs"):
            stage(nas, small / nas.filename, [0])
        assert not (small / f"{nas.filename}.partial").exists()
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_progress_arrives_while_the_copy_runs(nas: Nas, tmp_path: Path) -> None:
    dest = tmp_path / "node" / nas.filename
    seen: list[tuple[str, str, int, int, bool]] = []

    def on_progress(node: str, dest_path: str, done: int, total: int, phase: str) -> None:
        assert phase == "copy"
        # Live: the node script has not renamed its partial copy into place yet.
        seen.append((node, dest_path, done, total, Path(f"{dest}.partial").exists()))

    stage(nas, dest, [0], on_progress=on_progress)
    assert seen
    assert all(partial for *_, partial in seen)
    assert seen[-1][:2] == ("node-test", str(dest))
    assert seen[-1][2] == seen[-1][3] > 0


def node_shards(nas: Nas, root: Path, rank: int) -> list[EngramStage]:
    return [engram_stage(REPO, name, root / name, [rank]) for name in nas.all_shards]


def test_all_shards_of_a_node_in_one_launch(nas: Nas, tmp_path: Path) -> None:
    runner = LocalNode()
    shards = node_shards(nas, tmp_path / "node", 2)
    assert len(shards) == 2
    results = staging.stage_on_node(
        runner, "node-test", nas_hf_cache=str(nas.hf_cache), stages=shards, chunk_bytes=CHUNK
    )
    assert [result.status for result in results] == ["copied", "copied"]
    for shard, result in zip(shards, results, strict=True):
        assert result.dest == shard.dest
        assert_sparse_copy_of(nas.snapshot / shard.filename, Path(shard.dest), result.ranges)
    again = staging.stage_on_node(
        runner, "node-test", nas_hf_cache=str(nas.hf_cache), stages=shards
    )
    assert [result.status for result in again] == ["skipped", "skipped"]
    assert len(runner.streamed) == 2


def test_every_shard_is_checked_before_any_is_copied(nas: Nas, tmp_path: Path) -> None:
    shards = node_shards(nas, tmp_path / "node", 0)
    (nas.snapshot / shards[1].filename).unlink()
    with pytest.raises(StagingError, match=r"\[missing_source\]") as raised:
        staging.stage_on_node(
            LocalNode(), "node-test", nas_hf_cache=str(nas.hf_cache), stages=shards
        )
    assert shards[1].dest in str(raised.value)
    assert shards[0].dest not in str(raised.value)
    assert not (tmp_path / "node").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs")
def test_free_space_is_checked_for_all_copies_together(nas: Nas, tmp_path: Path) -> None:
    one = stage(nas, tmp_path / "probe" / nas.filename, [0])
    small = tmp_path / "small"
    small.mkdir()
    # Room for one rank-0 copy, not for both shards'.
    size_kib = (one.copied_bytes * 3 // 2) // 1024
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(small)], check=True
    )
    try:
        with pytest.raises(StagingError, match=r"\[no_space\].* and .* needs"):
            staging.stage_on_node(
                LocalNode(),
                "node-test",
                nas_hf_cache=str(nas.hf_cache),
                stages=node_shards(nas, small, 0),
            )
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)


@pytest.mark.lab
def test_lab_nodes_stage_their_ranks_over_ssh_and_compose(lab_cluster: Lab) -> None:
    """Three lab nodes at TP 3, over real SSH: staging, a skipped re-run, the composed dir."""
    repo_id = "lab-org/StagingOverSsh"
    generated = generate_repo(
        lab_cluster.nas_dir / "staging-test-repos", repo_id, engram=SPEC, tp_size=TP
    )
    hf_cache = lab_cluster.nas_dir / "hf-cache"
    snapshot = cache_repo(generated, hf_cache)
    engram_dir = "/var/tmp/engram-local/StagingOverSsh"
    composed_root = "/var/tmp/sparkdeploy/composed/staging-over-ssh"
    try:
        for rank, node in enumerate(lab_cluster.nodes):
            with ssh.connect(lab_cluster.ssh_target(node)) as connection:
                local_files = []
                for shard in generated.engram_shards.values():

                    def stage_over_ssh() -> StagingResult:
                        (result,) = staging.stage_on_node(
                            connection,
                            node,  # noqa: B023
                            nas_hf_cache=str(hf_cache),
                            stages=[
                                engram_stage(
                                    repo_id,
                                    shard,  # noqa: B023
                                    f"{engram_dir}/{shard}",  # noqa: B023
                                    [rank],  # noqa: B023
                                )
                            ],
                        )
                        return result

                    result = stage_over_ssh()
                    assert result.status == "copied"
                    data = (snapshot / shard).read_bytes()
                    assert list(result.range_sha256) == [
                        hashlib.sha256(data[begin:end]).hexdigest() for begin, end in result.ranges
                    ]
                    assert stage_over_ssh().status == "skipped"
                    local_files.append(result.dest)
                composed_plan = ComposedPlan(
                    root=composed_root,
                    sources=[RepoRef(repo=repo_id)],
                    local_files=local_files,
                    mount="/models",
                )
                composed = compose.compose_on_node(
                    connection, node, nas_hf_cache=str(hf_cache), composed=composed_plan
                )
                assert composed.status == "built"
                for local, entry in composed.hardlinks:
                    inodes = connection.run(["stat", "-c", "%i", local, entry], timeout=10)
                    first, second = inodes.stdout.split()
                    assert first == second
                again = compose.compose_on_node(
                    connection, node, nas_hf_cache=str(hf_cache), composed=composed_plan
                )
                assert again.status == "unchanged"
    finally:
        for node in lab_cluster.nodes:
            with ssh.connect(lab_cluster.ssh_target(node)) as connection:
                connection.run(["rm", "-rf", engram_dir, composed_root], timeout=30)
        shutil.rmtree(hf_cache / "models--lab-org--StagingOverSsh", ignore_errors=True)
        shutil.rmtree(lab_cluster.nas_dir / "staging-test-repos", ignore_errors=True)
