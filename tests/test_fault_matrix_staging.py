"""The fault matrix (tests/fault_matrix.py) while the Engram tables are staged on the nodes:
sshd killed mid-copy, the node's disk filling up, the copy killed."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fault_matrix import (
    BOUND_AT_ONCE_S,
    FAULT_MATRIX_MARKS,
    STRIKE_POLL_S,
    STRIKE_WAIT_S,
    Run,
    deploys,
    node_processes,
    nothing_left,
    on_node,
    run_flow,
)
from lab_flows import LAB_DSV41_RECIPE, Matrix

from flows.deploy import deploy
from flows.teardown import teardown
from lab.cluster import Lab
from lab.models import TINY_DSV41
from lab.testing.waiting import wait_for
from lab.tinymodel import EngramSpec, generate_repo
from sparkdeploy.spec.project import load_plan

pytestmark = FAULT_MATRIX_MARKS

FAULT_DSV41 = "lab/fault-dsv41"
# Engram tables of 48 MiB: a node's share of each is one 16 MiB copy chunk.
FAULT_TABLE_BYTES = 48 << 20
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
# The share of a CPU a slowed node's SSH sessions get: a staging copy then takes seconds.
SLOW_PERCENT = 3


@pytest.fixture(scope="module")
def fault_dsv41(lab_cluster: Lab, tmp_path_factory: pytest.TempPathFactory) -> str:
    """lab-dsv41-3x on a model whose Engram tables take a while to copy."""
    generate_repo(
        lab_cluster.hub_repos_dir,
        FAULT_DSV41,
        num_shards=TINY_DSV41.num_shards,
        total_bytes=TINY_DSV41.total_bytes,
        engram=EngramSpec.for_table_bytes(FAULT_TABLE_BYTES, n_heads=3),
        tp_size=TINY_DSV41.tp_size,
    )
    recipe = tmp_path_factory.mktemp("recipes") / "lab-fault-dsv41" / "recipe.toml"
    recipe.parent.mkdir()
    recipe.write_text(LAB_DSV41_RECIPE.read_text().replace("tiny-dsv41", "fault-dsv41"))
    return str(recipe.parent)


def staged_files(cluster: str, recipe: str, node: str) -> list[str]:
    plan_node = next(n for n in load_plan(recipe, cluster).nodes if n.node == node)
    return [stage.dest for stage in plan_node.engram]


def forget_staged(lab: Lab, cluster: str, recipe: str, node: str) -> list[str]:
    """The node's copies of the recipe's Engram shards removed, so the next deploy copies."""
    dests = staged_files(cluster, recipe, node)
    for dest in dests:
        on_node(
            lab,
            node,
            "rm",
            "-f",
            dest,
            f"{dest}.manifest.json",
            f"{dest}.partial",
            f"{dest}.partial.journal.json",
        )
    return dests


class SlowedSessions:
    """A node's SSH sessions (everything its sshd starts from now) get SLOW_PERCENT of a CPU, so
    a step there is caught mid-way: a cgroup under the node's own (which `lab down` removes).
    restore() moves every process back to full speed."""

    def __init__(self, lab: Lab, node: str) -> None:
        self.cgroup = CPU_CGROUP / lab.layout.cgroup_parent(node) / "slow-sessions"
        self.cgroup.mkdir(parents=True, exist_ok=True)
        (self.cgroup / "cpu.cfs_period_us").write_text("100000")
        (self.cgroup / "cpu.cfs_quota_us").write_text(str(SLOW_PERCENT * 1000))
        (self.cgroup / "cgroup.procs").write_text(str(lab.daemon_pid(f"{node}/sshd")))

    def restore(self) -> None:
        if not self.cgroup.exists():
            return
        for pid in (self.cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (CPU_CGROUP / "cgroup.procs").write_text(pid)
        self.cgroup.rmdir()


def staging_process(lab: Lab, node: str) -> int | None:
    """The node's staging script (its request is the JSON with "stages" in its argv)."""
    for pid, (_, name, cmdline) in node_processes(lab, node).items():
        if name.startswith("python") and '"stages"' in cmdline:
            return pid
    return None


@contextlib.contextmanager
def during_staging(
    lab: Lab, node: str, dests: list[str], fault: Callable[[int], None]
) -> Iterator[list[float]]:
    """fault(staging pid) once the node's staging copy has begun writing (its first .partial
    exists), with the copy paused meanwhile and back at full speed after; yields the list the
    fault's time goes into."""
    struck: list[float] = []
    errors: list[BaseException] = []
    slowed = SlowedSessions(lab, node)

    def strike() -> None:
        try:
            partials = [lab.node_path(node, f"{dest}.partial") for dest in dests]
            wait_for(
                "staging copy",
                lambda: any(p.exists() for p in partials),
                timeout_s=STRIKE_WAIT_S,
                poll_s=STRIKE_POLL_S,
            )
            pid = wait_for(
                "staging process",
                lambda: staging_process(lab, node),
                timeout_s=STRIKE_WAIT_S,
                poll_s=STRIKE_POLL_S,
            )
            os.kill(pid, signal.SIGSTOP)
            try:
                struck.append(time.time())
                fault(pid)
            finally:
                slowed.restore()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        except BaseException as error:
            errors.append(error)

    striker = threading.Thread(target=strike)
    striker.start()
    try:
        yield struck
    finally:
        striker.join()
        slowed.restore()
    if errors:
        raise errors[0]
    assert struck, "the fault never struck"


def stage_results(run: Run, node: str) -> set[str]:
    """The statuses (copied, resumed, skipped) the staging step logged for the node."""
    return {
        match.group(1)
        for message, _ in run.logs
        if (match := re.match(rf"node {node}: \S+: (copied|resumed|skipped), share", message))
    }


def test_sshd_killed_mid_staging_is_retried_on_a_new_connection_and_the_copy_resumes(
    cluster: str, lab_cluster: Lab, fault_dsv41: str, matrix: Matrix
) -> None:
    """node2's sshd and every session of it killed while its copy runs, then started again
    (as a service manager restarts it)."""
    dests = forget_staged(lab_cluster, cluster, fault_dsv41, "node2")

    def kill_sshd(_: int) -> None:
        lab_cluster.stop_daemon("node2/sshd")
        lab_cluster.start_daemon("node2/sshd")

    with during_staging(lab_cluster, "node2", dests, kill_sshd) as struck:
        run = run_flow(deploy, fault_dsv41, cluster=cluster, skip=["smoke-test"])
    assert run.state.is_completed(), run.state.message
    attempt = run.named("stage-engram", node="node2", cause="connection (was )?lost")
    assert not attempt.final
    assert stage_results(run, "node2") & {"copied", "resumed"}
    matrix.record(
        "sshd killed mid-staging",
        "stage-engram: the SSH channel closes without EOF; retried on a new connection",
        attempt.at - struck[0],
        BOUND_AT_ONCE_S,
        outcome="recovered: the retry resumed the copy",
        field_note="the retry waits 10 s",
    )
    teardown(fault_dsv41, cluster=cluster)
    nothing_left(lab_cluster, cluster)


def test_a_node_disk_filling_up_during_staging_fails_naming_it(
    cluster: str, lab_cluster: Lab, fault_dsv41: str, matrix: Matrix
) -> None:
    """node2's Engram dir on a tmpfs with room for the copy, filled while the copy runs."""
    dests = forget_staged(lab_cluster, cluster, fault_dsv41, "node2")
    engram_dir = str(Path(dests[0]).parent)
    in_node2 = ["nsenter", f"--target={lab_cluster.daemon_pid('node2/sshd')}", "--mount", "--"]
    on_node(lab_cluster, "node2", "mkdir", "-p", engram_dir)
    subprocess.run(
        [*in_node2, "mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", engram_dir], check=True
    )

    def fill(_: int) -> None:
        filler = lab_cluster.node_path("node2", f"{engram_dir}/filler")
        with open(filler, "wb") as handle, contextlib.suppress(OSError):
            while True:
                handle.write(b"\0" * (1 << 20))

    try:
        with during_staging(lab_cluster, "node2", dests, fill) as struck:
            run = run_flow(deploy, fault_dsv41, cluster=cluster, skip=["smoke-test"])
        assert run.failed
        attempt = run.named("stage-engram", node="node2", cause=r"\[no_space\].*disk filled up")
        for dest in dests:
            assert not lab_cluster.node_path("node2", dest).exists()
    finally:
        subprocess.run([*in_node2, "umount", engram_dir], check=True)
    nothing_left(lab_cluster, cluster)
    matrix.record(
        "node disk full during staging",
        "stage-engram: a write fails with ENOSPC, named no_space (not retried)",
        attempt.at - struck[0],
        BOUND_AT_ONCE_S,
    )


def test_a_killed_staging_copy_fails_naming_it_and_the_re_run_resumes_it(
    cluster: str, lab_cluster: Lab, fault_dsv41: str, matrix: Matrix
) -> None:
    """Then the re-run of this fault and of the full disk above: node2 copies its shards
    (resuming what the killed copy made durable)."""
    dests = forget_staged(lab_cluster, cluster, fault_dsv41, "node2")

    def kill(pid: int) -> None:
        os.kill(pid, signal.SIGKILL)

    with during_staging(lab_cluster, "node2", dests, kill) as struck:
        run = run_flow(deploy, fault_dsv41, cluster=cluster, skip=["smoke-test"])
    assert run.failed
    attempt = run.named("stage-engram", node="node2", cause="killed by a signal")
    assert attempt.final
    for dest in dests:  # the copy is left as a partial, never as the file
        assert not lab_cluster.node_path("node2", dest).exists()
    nothing_left(lab_cluster, cluster)
    matrix.record(
        "staging copy killed",
        "stage-engram: the script ends without its answer (not retried)",
        attempt.at - struck[0],
        BOUND_AT_ONCE_S,
    )
    rerun = deploys(fault_dsv41, cluster, skip=["smoke-test"])  # the re-run, after both faults
    assert stage_results(rerun, "node2") & {"copied", "resumed"}
    teardown(fault_dsv41, cluster=cluster)
    nothing_left(lab_cluster, cluster)
