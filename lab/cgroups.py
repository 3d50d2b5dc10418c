"""The cgroup dirs a lab's dockerds put their containers under (one per node, in every mounted
hierarchy: the daemon config's cgroup-parent): found, their processes listed, removed."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from lab.processes import STOP_TIMEOUT_S
from sparkdeploy.errors import LabError

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers, named ones and the v2 tree)."""
    hierarchies = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mount_point, fstype, *_ = line.split()
        if fstype in ("cgroup", "cgroup2") and mount_point.startswith(str(CGROUP_ROOT)):
            hierarchies.append(Path(mount_point))
    return hierarchies


def existing_cgroup_dirs(cgroup_prefix: str) -> list[Path]:
    """The lab's nodes' cgroup dirs in every hierarchy, whatever its node count."""
    pattern = re.compile(rf"{re.escape(cgroup_prefix)}node\d+")
    found = []
    for hierarchy in cgroup_hierarchies():
        found += [entry for entry in hierarchy.iterdir() if pattern.fullmatch(entry.name)]
    return sorted(found)


def cgroup_pids(directory: Path) -> set[int]:
    """Every process in the cgroup dir or below it."""
    pids: set[int] = set()
    for procs in directory.rglob("cgroup.procs"):
        try:
            pids.update(int(pid) for pid in procs.read_text().split())
        except OSError:
            continue
    return pids


def remove_cgroup_tree(directory: Path) -> None:
    """The cgroup dir and every one below it, deepest first (a cgroup dir with children or
    tasks cannot go)."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for current, _, _ in sorted(os.walk(directory, topdown=False), key=lambda w: -len(w[0])):
        while True:
            try:
                os.rmdir(current)
                break
            except FileNotFoundError:
                break
            except OSError as error:
                # EBUSY while the last task of a just-killed container is still exiting.
                if time.monotonic() > deadline:
                    raise LabError(f"cannot remove cgroup dir {current}: {error}") from error
                time.sleep(0.02)
