"""First process of a lab node: private mounts, hostname, dockerd, then it becomes sshd.

Started by lab.daemons as
    nsenter --net=/run/netns/<node netns> -- unshare --mount --uts --propagation private --
        python3 -S -E lab/nodeinit.py NODE_DIR HOSTNAME
so it already runs in the node's network, mount and UTS namespaces. Stdlib only and no package
imports, because it runs with -S for a fast start. Every process of the node (dockerd, its
containerd and containers, every SSH session) descends from here and shares this mount
namespace, which the kernel discards with its last process: `lab down` has nothing to unmount.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

MOUNT_TIMEOUT_S = 10
DOCKERD = "/usr/sbin/dockerd"
SSHD = "/usr/sbin/sshd"
NODE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, timeout=MOUNT_TIMEOUT_S)


def remount_sysfs_for_this_netns(node_dir: Path) -> None:
    """/sys/class/net must show this namespace's interfaces; dockerd needs the cgroup mounts.

    A fresh sysfs has an empty /sys/fs/cgroup, so the cgroup tree is parked, sysfs mounted over
    /sys, and the cgroup tree moved back on top of it.
    """
    parked = node_dir / "cgroup-parked"
    parked.mkdir(exist_ok=True)
    mount("--rbind", "/sys/fs/cgroup", str(parked))
    mount("-t", "sysfs", "sysfs", "/sys")
    mount("--move", str(parked), "/sys/fs/cgroup")


def mount_private_dirs(node_dir: Path) -> None:
    """Give the node its own /run, /tmp, /var (tmp, lib/docker, log ...), /etc config dirs, its
    machine id and root's home (a node's ~ is its own, and the host's shell profile does not run
    in every SSH command).

    /var is an overlay of the host's /var whose upper layer has `tmp -> /tmp`: /tmp and /var/tmp
    are then one mount, so link() between them works as on a real node (two bind mounts would
    be two mounts, and link() across them fails with EXDEV).
    """
    mount("--bind", str(node_dir / "run"), "/run")
    mount("--bind", str(node_dir / "tmp"), "/tmp")
    overlay_options = (
        f"lowerdir=/var,upperdir={node_dir / 'var-upper'},workdir={node_dir / 'var-work'}"
    )
    mount("-t", "overlay", "overlay", "-o", overlay_options, "/var")
    # overlay2 cannot sit on overlayfs: docker's data root is a bind of a plain directory.
    Path("/var/lib/docker").mkdir(parents=True, exist_ok=True)
    mount("--bind", str(node_dir / "docker"), "/var/lib/docker")
    mount("--bind", str(node_dir / "etc-ssh"), "/etc/ssh")
    mount("--bind", str(node_dir / "etc-docker"), "/etc/docker")
    mount("--bind", str(node_dir / "hosts"), "/etc/hosts")
    # Each node is its own machine to the node locks (sparkdeploy.remote.node_identity).
    mount("--bind", str(node_dir / "machine-id"), "/etc/machine-id")
    mount("--bind", str(node_dir / "home-root"), "/root")
    # vLLM's processes share memory through /dev/shm (containers run with --ipc host): each node
    # has its own, as a real one does, and what a killed engine leaves there goes with the node.
    mount("-t", "tmpfs", "-o", "mode=1777,size=4g", "tmpfs", "/dev/shm")


def start_dockerd(node_dir: Path) -> None:
    log = (node_dir / "dockerd.log").open("ab")
    subprocess.Popen(
        [DOCKERD, "--config-file", "/etc/docker/daemon.json"],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        env={"PATH": NODE_PATH, "HOME": "/root"},
        start_new_session=True,
    )
    log.close()


def become_sshd(node_dir: Path) -> None:
    log_fd = os.open(node_dir / "sshd.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.execve(
        SSHD,
        [SSHD, "-D", "-e", "-f", "/etc/ssh/sshd_config"],
        {"PATH": NODE_PATH, "LANG": "C.UTF-8"},
    )


def main(argv: list[str]) -> None:
    node_dir = Path(argv[1])
    hostname = argv[2]
    remount_sysfs_for_this_netns(node_dir)
    subprocess.run(["hostname", hostname], check=True, timeout=MOUNT_TIMEOUT_S)
    mount_private_dirs(node_dir)
    start_dockerd(node_dir)
    become_sshd(node_dir)


if __name__ == "__main__":
    main(sys.argv)
