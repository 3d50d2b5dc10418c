"""The composed model dir, built by the node script in a stdlib-only python3."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from huggingface_hub import scan_cache_dir, snapshot_download

from lab.testing.hfcache_layout import cache_repo, commit_of
from lab.testing.local_node import LocalNode
from lab.tinymodel import EngramSpec, generate_repo
from sparkdeploy.errors import ComposeError
from sparkdeploy.spec.plan import ComposedPlan, EngramStage
from sparkdeploy.spec.recipe import RepoRef
from sparkdeploy.steps import compose_model as compose
from sparkdeploy.steps import stage_engram as staging

REPO = "lab-org/TinyEngram"
STANDIN = Path(__file__).resolve().parents[1] / "lab" / "engine" / "vllm_standin.py"


@dataclass
class Layout:
    hf_cache: Path
    snapshot: Path
    local_dir: Path
    local_files: list[Path]
    root: Path


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    repo = generate_repo(tmp_path / "repos", REPO, engram=EngramSpec(n_heads=3), tp_size=3)
    snapshot = cache_repo(repo, tmp_path / "nas")
    local_dir = tmp_path / "var-tmp" / "engram-local"
    local_dir.mkdir(parents=True)
    local_files = []
    for shard in repo.engram_shards.values():
        local = local_dir / shard
        # Stands in for the staged sparse copy: any regular file of that name.
        local.write_bytes(b"rank-local " + shard.encode())
        local_files.append(local)
    root = tmp_path / "var-tmp" / "composed" / "tiny"
    return Layout(tmp_path / "nas", snapshot, local_dir, local_files, root)


def run(layout: Layout, *, revision: str | None = None) -> compose.ComposeResult:
    return compose.compose_on_node(
        LocalNode(),
        "node-test",
        nas_hf_cache=str(layout.hf_cache),
        composed=ComposedPlan(
            root=str(layout.root),
            sources=[RepoRef(repo=REPO, revision=revision)],
            local_files=[str(path) for path in layout.local_files],
            mount="/models",
        ),
    )


def composed_snapshot(layout: Layout) -> Path:
    return layout.root / "models--lab-org--TinyEngram" / "snapshots" / commit_of(REPO, "1")


def test_snapshot_symlinks_to_the_nas_and_local_files_win(layout: Layout) -> None:
    result = run(layout)
    assert result.status == "built"
    assert result.sources == ((REPO, commit_of(REPO, "1")),)
    snapshot = composed_snapshot(layout)
    local_names = {path.name for path in layout.local_files}
    nas_entries = {path.name for path in layout.snapshot.iterdir()}
    assert {path.name for path in snapshot.iterdir()} == nas_entries
    for entry in snapshot.iterdir():
        if entry.name in local_names:
            assert not entry.is_symlink()
            assert entry.stat().st_ino == (layout.local_dir / entry.name).stat().st_ino
        else:
            assert os.readlink(entry) == str(layout.snapshot / entry.name)
    refs = layout.root / "models--lab-org--TinyEngram" / "refs" / "main"
    assert refs.read_text() == commit_of(REPO, "1")
    assert {(str(local), str(snapshot / local.name)) for local in layout.local_files} == set(
        result.hardlinks
    )


def test_hf_hub_resolves_the_composed_model_offline(layout: Layout) -> None:
    run(layout)
    resolved = Path(snapshot_download(REPO, cache_dir=layout.root, local_files_only=True))
    assert resolved == composed_snapshot(layout)
    assert json.loads((resolved / "config.json").read_text())["lab_revision"] == "1"
    local = layout.local_files[0]
    assert (resolved / local.name).read_bytes() == local.read_bytes()


def test_huggingface_hub_scans_the_composed_dir_as_a_clean_cache(layout: Layout) -> None:
    run(layout)
    scanned = scan_cache_dir(layout.root)
    assert scanned.warnings == []
    (repo,) = scanned.repos
    assert repo.repo_id == REPO
    assert [revision.commit_hash for revision in repo.revisions] == [commit_of(REPO, "1")]


def test_pinned_revision_gets_its_ref(layout: Layout) -> None:
    refs = layout.hf_cache / "models--lab-org--TinyEngram" / "refs"
    (refs / "v1").write_text(commit_of(REPO, "1"))
    run(layout, revision="v1")
    composed_refs = layout.root / "models--lab-org--TinyEngram" / "refs"
    assert {path.name for path in composed_refs.iterdir()} == {"main", "v1"}


def test_unchanged_composition_is_left_alone(layout: Layout) -> None:
    run(layout)
    before = layout.root.stat().st_ino
    result = run(layout)
    assert result.status == "unchanged"
    assert layout.root.stat().st_ino == before


def test_restaged_local_file_rebuilds(layout: Layout) -> None:
    run(layout)
    local = layout.local_files[0]
    # Staging replaces a copy by renaming a new file over it: a new inode.
    replacement = local.with_name(local.name + ".new")
    replacement.write_bytes(b"other rank")
    replacement.replace(local)
    result = run(layout)
    assert result.status == "rebuilt"
    assert (composed_snapshot(layout) / local.name).read_bytes() == b"other rank"
    leftovers = [p.name for p in layout.root.parent.iterdir() if p.name != layout.root.name]
    assert leftovers == []


def test_hardlink_across_mounts_names_both_paths_and_the_fix(layout: Layout) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == layout.root.parent.parent.stat().st_dev:
        pytest.skip("needs /dev/shm on another mount than the test's tmp dir")
    other_mount = shm / f"sparkdeploy-test-{os.getpid()}"
    other_mount.mkdir()
    try:
        moved = other_mount / layout.local_files[0].name
        shutil.move(layout.local_files[0], moved)
        layout.local_files[0] = moved
        with pytest.raises(ComposeError, match=r"\[exdev\]") as raised:
            run(layout)
    finally:
        shutil.rmtree(other_mount)
    message = str(raised.value)
    assert str(moved) in message
    assert str(composed_snapshot(layout) / moved.name) in message
    assert "[[composed_model.local_files]] host path and the inventory's" in message
    assert "node_paths.composed_root on one filesystem and one mount" in message
    assert not layout.root.exists()


def test_missing_local_file_says_run_staging(layout: Layout) -> None:
    layout.local_files[0].unlink()
    with pytest.raises(ComposeError, match=r"\[missing_local\]") as raised:
        run(layout)
    assert str(layout.local_files[0]) in str(raised.value)
    assert str(composed_snapshot(layout) / layout.local_files[0].name) in str(raised.value)
    assert "staging" in str(raised.value)


def test_local_file_that_replaces_nothing_is_an_error(layout: Layout) -> None:
    stray = layout.local_dir / "model-99999-of-99999.safetensors"
    stray.write_bytes(b"x")
    layout.local_files.append(stray)
    with pytest.raises(ComposeError, match=r"\[unmatched_local\].*model-99999"):
        run(layout)


def test_missing_source_names_the_repo(layout: Layout) -> None:
    shutil.rmtree(layout.hf_cache / "models--lab-org--TinyEngram")
    with pytest.raises(ComposeError, match=r"\[missing_source\].*lab-org/TinyEngram.*prefetch"):
        run(layout)


def test_a_dir_not_built_by_us_is_never_replaced(layout: Layout) -> None:
    layout.root.mkdir(parents=True)
    (layout.root / "precious").write_text("keep")
    with pytest.raises(ComposeError, match=r"\[foreign_dir\]"):
        run(layout)
    assert (layout.root / "precious").read_text() == "keep"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
            return int(reply.status)
    except OSError:
        return None


def test_engine_standin_boots_offline_from_staged_and_composed_dirs(tmp_path: Path) -> None:
    """Three "nodes" at TP 3: each stages its rank's sparse copies, composes, boots the engine
    stand-in on the composed dir; each stand-in checks its own rank's Engram rows."""
    repo = generate_repo(tmp_path / "repos", REPO, engram=EngramSpec(n_heads=3), tp_size=3)
    nas = tmp_path / "nas"
    cache_repo(repo, nas)
    roots = []
    for rank in range(3):
        local_dir = tmp_path / f"node{rank}" / "engram-local"
        stages = [
            EngramStage(
                repo=RepoRef(repo=REPO),
                filename=shard,
                dest=str(local_dir / shard),
                ranks=[rank],
                tp_size=3,
            )
            for shard in repo.engram_shards.values()
        ]
        staged = staging.stage_on_node(
            LocalNode(), f"node{rank}", nas_hf_cache=str(nas), stages=stages
        )
        assert [result.status for result in staged] == ["copied"] * len(stages)
        root = tmp_path / f"node{rank}" / "composed" / "tiny"
        composed = compose.compose_on_node(
            LocalNode(),
            f"node{rank}",
            nas_hf_cache=str(nas),
            composed=ComposedPlan(
                root=str(root),
                sources=[RepoRef(repo=REPO)],
                local_files=[result.dest for result in staged],
                mount="/models",
            ),
        )
        assert composed.status == "built"
        roots.append(root)
    api_port, master_port = free_port(), free_port()
    engines: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for rank, root in enumerate(roots):
            argv = [sys.executable, str(STANDIN), "serve", REPO, "--tensor-parallel-size", "3"]
            argv += ["--nnodes", "3", "--node-rank", str(rank), "--master-addr", "127.0.0.1"]
            argv += ["--master-port", str(master_port)]
            argv += ["--headless"] if rank else ["--host", "127.0.0.1", "--port", str(api_port)]
            env = {k: v for k, v in os.environ.items() if not k.startswith(("STANDIN_", "VLLM_"))}
            env.update(
                HF_HUB_OFFLINE="1",
                HF_HUB_CACHE=str(root),
                VLLM_HOST_IP=f"127.0.0.{rank + 1}",
                PYTHONPATH=str(STANDIN.parents[2]),
            )
            log_path = tmp_path / f"engine{rank}.log"
            with open(log_path, "wb") as log_file:
                process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env)
            engines.append((process, log_path))
        head = engines[0][0]
        deadline = time.monotonic() + 60
        while health(api_port) != 200 and head.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        logs = [log_path.read_text() for _, log_path in engines]
        assert health(api_port) == 200, logs[0]
    finally:
        for process, _ in engines:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
    for rank, log in enumerate(logs):
        verified = [line for line in log.splitlines() if "Engram table verified" in line]
        assert len(verified) == len(repo.engram_shards), log
        assert all(f"of TP rank {rank}/3" in line for line in verified), log
