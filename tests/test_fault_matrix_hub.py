"""The fault matrix (tests/fault_matrix.py) on the hub and the NAS: the hub answering 503,
cutting a file mid-way, serving wrong bytes; the NAS filling up during the prefetch."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_matrix import (
    BOUND_AT_ONCE_S,
    FAULT_MATRIX_MARKS,
    Run,
    deploys,
    hub_faults,
    nothing_left,
    run_flow,
)
from lab_flows import LAB_SINGLE_RECIPE, Matrix, recipe_variant

from flows.deploy import deploy
from flows.teardown import teardown
from lab.cluster import Lab
from lab.models import TINY_CHAT
from lab.tinymodel import generate_repo
from sparkdeploy.spec.cluster import load_cluster

pytestmark = FAULT_MATRIX_MARKS

FAULT_CHAT = "lab/fault-chat"
CUT_AFTER_BYTES = 10


@pytest.fixture(scope="module")
def fault_chat(lab_cluster: Lab, tmp_path_factory: pytest.TempPathFactory) -> str:
    """lab-single serving its own copy of the tiny chat model, which each hub test removes from
    the NAS first, so the prefetch fetches it."""
    generate_repo(
        lab_cluster.hub_repos_dir,
        FAULT_CHAT,
        num_shards=TINY_CHAT.num_shards,
        total_bytes=TINY_CHAT.total_bytes,
    )
    return recipe_variant(
        tmp_path_factory.mktemp("recipes"),
        "lab-fault-chat",
        LAB_SINGLE_RECIPE,
        ('model = "lab/tiny-chat"', f'model = "{FAULT_CHAT}"'),
    )


def nas_repo(cluster: str, repo: str) -> Path:
    return Path(load_cluster(Path(cluster)).nas.hf_cache) / ("models--" + repo.replace("/", "--"))


def assert_nas_repo_complete_or_absent(lab: Lab, cluster: str, repo: str) -> None:
    """Every file the NAS snapshot links is the hub's file, byte for byte; a partial download
    (*.incomplete) is never linked. Without a manifest, nothing may claim the repo complete."""
    storage = nas_repo(cluster, repo)
    source = lab.hub_repos_dir / repo
    for snapshot in (storage / "snapshots").glob("*"):
        for entry in snapshot.rglob("*"):
            if entry.is_symlink() or entry.is_file():
                target = entry.resolve()
                assert not target.name.endswith(".incomplete"), f"{entry} links a partial"
                relative = entry.relative_to(snapshot)
                assert target.read_bytes() == (source / relative).read_bytes(), entry


def test_hub_503s_are_retried_and_the_deploy_recovers(
    cluster: str, lab_cluster: Lab, fault_chat: str, matrix: Matrix
) -> None:
    subprocess.run(["rm", "-rf", str(nas_repo(cluster, FAULT_CHAT))], check=True)
    failing_at = time.time()
    hub_faults(lab_cluster, fail_next=2, status=503)
    try:
        run = run_flow(deploy, fault_chat, cluster=cluster, skip=["smoke-test"])
    finally:
        hub_faults(lab_cluster, reset=True)
    assert run.state.is_completed(), run.state.message
    attempt = run.named("prefetch", node=lab_cluster.hub_url, cause="503")
    assert not attempt.final
    assert_nas_repo_complete_or_absent(lab_cluster, cluster, FAULT_CHAT)
    matrix.record(
        "hub answers 503",
        "prefetch: the hub's 5xx is transient; the task retries",
        attempt.at - failing_at,
        BOUND_AT_ONCE_S,
        outcome="recovered",
        field_note="the prefetch retries wait 10, 60, 300 s",
    )
    teardown(fault_chat, cluster=cluster)
    nothing_left(lab_cluster, cluster)


def prefetch_said(run: Run, pattern: str) -> float:
    """When the prefetch task logged a line matching pattern (what it recovered from inside)."""
    said = [at for message, at in run.logs if re.search(pattern, message)]
    assert said, f"the prefetch never said {pattern!r}"
    return said[0]


def test_a_hub_cutting_a_file_mid_way_is_resumed_from_the_byte_it_reached(
    cluster: str, lab_cluster: Lab, fault_chat: str, matrix: Matrix
) -> None:
    subprocess.run(["rm", "-rf", str(nas_repo(cluster, FAULT_CHAT))], check=True)
    cut_at = time.time()
    # Whichever file goes first is cut (the smallest is 50 bytes), so the test does not depend
    # on which of the parallel downloads the hub serves first.
    hub_faults(lab_cluster, cut_next_file=CUT_AFTER_BYTES)
    try:
        run = run_flow(deploy, fault_chat, cluster=cluster, skip=["smoke-test"])
    finally:
        hub_faults(lab_cluster, reset=True)
    assert run.state.is_completed(), run.state.message
    seen = prefetch_said(run, rf"retrying from byte {CUT_AFTER_BYTES} ")
    assert_nas_repo_complete_or_absent(lab_cluster, cluster, FAULT_CHAT)
    matrix.record(
        "hub cuts a file mid-way",
        "prefetch: the body ends short; the download resumes from that byte (Range)",
        seen - cut_at,
        BOUND_AT_ONCE_S,
        outcome="recovered inside the step",
    )
    teardown(fault_chat, cluster=cluster)
    nothing_left(lab_cluster, cluster)


@contextlib.contextmanager
def served_wrong(path: Path) -> Iterator[None]:
    """The hub serves other bytes for `path` under the digests it listed: the file changed in
    place with its size, inode and mtime kept (what the hub's digest cache keys on)."""
    original = path.read_bytes()
    stat = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(len(original) // 2)
        handle.write(bytes(255 - byte for byte in original[len(original) // 2 :][:4096]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    try:
        yield
    finally:
        path.write_bytes(original)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_hub_serving_wrong_bytes_fails_naming_the_file_and_nothing_corrupt_is_kept(
    cluster: str, lab_cluster: Lab, fault_chat: str, matrix: Matrix
) -> None:
    subprocess.run(["rm", "-rf", str(nas_repo(cluster, FAULT_CHAT))], check=True)
    shard = sorted((lab_cluster.hub_repos_dir / FAULT_CHAT).glob("*.safetensors"))[0]
    with served_wrong(shard):
        corrupt_at = time.time()
        run = run_flow(deploy, fault_chat, cluster=cluster, skip=["smoke-test"])
    assert run.failed
    attempt = run.named("prefetch", node=shard.name, cause="the hub's copy is corrupt")
    assert attempt.final  # a corrupt file is no transient failure: no retry
    assert_nas_repo_complete_or_absent(lab_cluster, cluster, FAULT_CHAT)
    assert not list(nas_repo(cluster, FAULT_CHAT).glob(".sparkdeploy/*.json")), "a manifest"
    nothing_left(lab_cluster, cluster)
    matrix.record(
        "hub serves wrong bytes",
        "prefetch: the sha256 differs from the hub's listing twice (fetched again once)",
        attempt.at - corrupt_at,
        BOUND_AT_ONCE_S,
    )


def test_the_nas_filling_up_during_the_prefetch_fails_naming_it(
    cluster: str, lab_cluster: Lab, fault_chat: str, matrix: Matrix
) -> None:
    """The repo's NAS directory on a 256 KiB tmpfs: room enough for the free-space check of
    the cache as a whole, not for the 1 MiB of the repo."""
    storage = nas_repo(cluster, FAULT_CHAT)
    subprocess.run(["rm", "-rf", str(storage)], check=True)
    storage.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(storage)], check=True)
    try:
        full_at = time.time()
        run = run_flow(deploy, fault_chat, cluster=cluster, skip=["smoke-test"])
        assert run.failed
        attempt = run.named("prefetch", node=str(storage), cause="No space left on device")
        assert_nas_repo_complete_or_absent(lab_cluster, cluster, FAULT_CHAT)
        assert not list(storage.glob(".sparkdeploy/*.json")), "a manifest of a partial repo"
    finally:
        subprocess.run(["umount", str(storage)], check=True)
    nothing_left(lab_cluster, cluster)
    matrix.record(
        "NAS full during the prefetch",
        "prefetch: a write fails with ENOSPC (not retried)",
        attempt.at - full_at,
        BOUND_AT_ONCE_S,
    )


def test_after_the_hub_and_nas_faults_the_recipe_deploys(
    cluster: str, lab_cluster: Lab, fault_chat: str
) -> None:
    """The re-run of the two faults above that failed (the hub's file restored, the NAS
    unmounted): the prefetch fetches what it lacks and verifies it all."""
    deploys(fault_chat, cluster, skip=["smoke-test"])
    assert_nas_repo_complete_or_absent(lab_cluster, cluster, FAULT_CHAT)
    assert list(nas_repo(cluster, FAULT_CHAT).glob(".sparkdeploy/*.json")), "no manifest"
    teardown(fault_chat, cluster=cluster)
    nothing_left(lab_cluster, cluster)
