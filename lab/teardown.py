"""Removing a lab, also a crashed one, and finding what of it is left. Both go by what is on
the machine (namespaces, cgroup dirs, host link, mounts, state dir), never by the state file,
which a crash may not have written."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lab.cgroups import cgroup_pids, existing_cgroup_dirs, remove_cgroup_tree
from lab.layout import LabLayout
from lab.network import (
    delete_host_link,
    delete_netns,
    existing_netns,
    host_link_exists,
    netns_pids,
)
from lab.processes import alive, describe, run, terminate
from sparkdeploy.errors import LabError
from sparkdeploy.node.docker_facts import EngineApi

STOP_ROUNDS = 3


def remove_lab(layout: LabLayout) -> None:
    """Every trace of the lab: containers, processes, cgroup dirs, namespaces, host link,
    mounts and state dir."""
    netns_names = existing_netns(layout.netns_prefix)
    cgroup_dirs = existing_cgroup_dirs(layout.cgroup_prefix)
    _remove_containers(layout.state_dir)
    _stop_processes(layout.name, netns_names, cgroup_dirs)
    for directory in cgroup_dirs:
        remove_cgroup_tree(directory)
    delete_netns(netns_names)
    delete_host_link(layout.host_link)
    for mount_point in sorted(_leftover_mounts(layout.state_dir), reverse=True):
        run(["umount", "--lazy", mount_point])
    shutil.rmtree(layout.state_dir, ignore_errors=True)
    if layout.state_dir.exists():
        raise LabError(f"lab {layout.name!r}: could not remove {layout.state_dir}")


def remains(layout: LabLayout) -> list[str]:
    """What of this lab exists on the machine: namespaces, cgroup dirs, host link, state dir,
    mounts."""
    found = [f"netns {name}" for name in existing_netns(layout.netns_prefix)]
    found += [f"cgroup {path}" for path in existing_cgroup_dirs(layout.cgroup_prefix)]
    if host_link_exists(layout.host_link):
        found.append(f"link {layout.host_link}")
    if layout.state_dir.exists():
        found.append(f"dir {layout.state_dir}")
    found += [f"mount {mount}" for mount in _leftover_mounts(layout.state_dir)]
    return found


def _remove_containers(state_dir: Path) -> None:
    """Containers go through their dockerd first, so it cleans its mounts and cgroups."""
    sockets = sorted(state_dir.glob("node*/run/docker.sock"))
    with ThreadPoolExecutor(max_workers=max(1, len(sockets))) as pool:
        list(pool.map(_remove_all_containers, sockets))


def _remove_all_containers(socket_path: Path) -> None:
    engine = EngineApi(str(socket_path), timeout=10)
    try:
        status, containers = engine.get("/containers/json?all=1")
        if status != 200:
            raise OSError(f"GET /containers/json on {socket_path} answered {status}: {containers}")
        for container in containers:
            engine.request("DELETE", f"/containers/{container['Id']}?force=1&v=1")
    except OSError:
        # No dockerd behind the socket (crashed lab): its containers die with the cgroup sweep.
        return


def _stop_processes(lab_name: str, netns_names: list[str], cgroup_dirs: list[Path]) -> None:
    """Every process in the lab's namespaces and cgroups, until none is left: the scan is
    repeated because one may fork between a scan and its signal (an SSH session starting,
    dockerd spawning a shim)."""
    for _ in range(STOP_ROUNDS):
        pids: set[int] = set()
        for name in netns_names:
            pids.update(netns_pids(name))
        for directory in cgroup_dirs:
            pids.update(cgroup_pids(directory))
        pids.discard(os.getpid())
        pids = {pid for pid in pids if alive(pid)}
        if not pids:
            return
        terminate(pids)
    raise LabError(
        f"lab {lab_name!r}: processes kept appearing in its namespaces and cgroups after"
        f" {STOP_ROUNDS} rounds of SIGTERM/SIGKILL; the last: {describe(pids)}"
    )


def _leftover_mounts(state_dir: Path) -> list[str]:
    """Mount points at or below the lab's state dir, as the host's mount namespace sees them."""
    root = str(state_dir)
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mount_point = line.split()[4]
        if mount_point == root or mount_point.startswith(root + "/"):
            mounts.append(mount_point)
    return mounts
