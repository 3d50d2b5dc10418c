"""Facts about one node in one SSH round trip: docker, an image, disk, memory, GPUs, RDMA.

Standard library + sparkdeploy.node.docker_facts: sparkdeploy.remote.node_script ships them to
the node, whose python3 runs `main([mode, request_json])`; the last stdout line is the JSON
answer. Modes:

- `image`: {"image"} -> the image's id/size/labels (or null), docker's root dir and its free
  bytes, and the registry mirrors docker pulls through.
- `preflight`: {"image", "paths", "create", "gpus", "fabric_ip", "detect_rdma",
  "unified_memory", "required_free_bytes", "drop_page_cache", "stale_label"} -> (the `create`
  dirs made first) the above plus missing paths, the memory figures of /proc/meminfo (after
  dropping the page cache when allowed and needed: `check_memory`), the GPU's compute processes,
  GPU count, RDMA facts, and the IDs of the containers labelled `stale_label` (running or not)
  and the running containers without that label (another team's: named, never touched).
- `look`: {"image", "stale_label"} -> what `preflight` says of docker, the image and the
  containers, and nothing else: it makes no dir, drops no cache (a preview, which writes
  nothing on the node).
- `reach`: {"urls"} -> for each URL, null when a TCP connection to its host and port opens
  within REACH_TIMEOUT_S, else the error: whether a registry answers from the node.

docker is asked through its Engine API, or the docker CLI where it is configured to reach
another daemon (sparkdeploy.node.docker_facts).

RDMA facts follow docs/field.md: an HCA is used when a port is ACTIVE on an Ethernet link layer
(RoCE); NCCL_IB_GID_INDEX is the index of a RoCE v2 GID holding an IPv4-mapped address,
preferably the node's fabric IP.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys

from sparkdeploy.node.docker_facts import DOCKER_TIMEOUT_S, docker_engine

# The node pays for each import at every start, so typing (and subprocess, which only nvidia-smi
# needs) are not imported there; mypy reads the annotations.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

REACH_TIMEOUT_S = 5
SYSFS_INFINIBAND = "/sys/class/infiniband"
_IPV4_MAPPED_PREFIX = "0" * 20 + "ffff"


def read_meminfo(meminfo: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo's figures in bytes (the kernel writes them in kB)."""
    figures = {}
    with open(meminfo) as lines:
        for line in lines:
            name, _, rest = line.partition(":")
            value = rest.split()
            if value and value[0].isdigit():
                figures[name] = int(value[0]) * 1024
    return figures


def memory_facts(meminfo: dict[str, int]) -> dict[str, int]:
    """Total, free (MemFree), available (MemAvailable) and the page cache a drop can free:
    file pages (Buffers + Cached) but shared memory, which Cached counts and no drop frees."""
    page_cache = meminfo.get("Buffers", 0) + meminfo.get("Cached", 0) - meminfo.get("Shmem", 0)
    return {
        "total": meminfo["MemTotal"],
        "free": meminfo["MemFree"],
        "available": meminfo.get("MemAvailable", meminfo["MemFree"]),
        "page_cache": max(0, page_cache),
    }


def gpu_count() -> int | None:
    """GPUs nvidia-smi lists; None when nvidia-smi is missing or fails."""
    import subprocess

    try:
        completed = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, timeout=DOCKER_TIMEOUT_S, check=False
        )
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    if completed.returncode != 0:
        return None
    return sum(1 for line in completed.stdout.decode().splitlines() if line.startswith("GPU "))


def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        # Unused GID slots answer EINVAL on real sysfs.
        return None


def ipv4_of_gid(gid: str) -> str | None:
    """The IPv4 address of an IPv4-mapped GID (::ffff:a.b.c.d), else None."""
    digits = gid.replace(":", "").lower()
    if len(digits) != 32 or not digits.startswith(_IPV4_MAPPED_PREFIX):
        return None
    tail = digits[24:]
    return ".".join(str(int(tail[i : i + 2], 16)) for i in range(0, 8, 2))


def detect_roce(root: str, fabric_ip: str | None) -> dict[str, Any]:
    """Active RoCE HCAs and the RoCE v2 IPv4 GID index under `root` (a /sys/class/infiniband)."""
    if not os.path.isdir(root):
        return {
            "devices": False,
            "hcas": [],
            "gid_index": None,
            "notes": [f"no RDMA devices ({root} is absent): NCCL_IB_HCA, NCCL_IB_GID_INDEX unset"],
        }
    hcas: list[str] = []
    candidates: list[tuple[str, int, str]] = []
    notes: list[str] = []
    for hca in sorted(os.listdir(root)):
        ports_dir = os.path.join(root, hca, "ports")
        active = False
        for port in sorted(os.listdir(ports_dir)) if os.path.isdir(ports_dir) else []:
            port_dir = os.path.join(ports_dir, port)
            state = _read(os.path.join(port_dir, "state")) or ""
            if "ACTIVE" not in state or _read(os.path.join(port_dir, "link_layer")) != "Ethernet":
                continue
            active = True
            gids_dir = os.path.join(port_dir, "gids")
            for entry in sorted(os.listdir(gids_dir), key=int) if os.path.isdir(gids_dir) else []:
                gid_type = _read(os.path.join(port_dir, "gid_attrs", "types", entry)) or ""
                address = ipv4_of_gid(_read(os.path.join(gids_dir, entry)) or "")
                if address is not None and gid_type.lower() == "roce v2":
                    candidates.append((hca, int(entry), address))
        if active:
            hcas.append(hca)
        else:
            notes.append(f"{hca}: no ACTIVE RoCE port, left out of NCCL_IB_HCA")
    matching = [c for c in candidates if c[2] == fabric_ip]
    if not candidates:
        if hcas:
            notes.append("no RoCE v2 GID with an IPv4 address: NCCL_IB_GID_INDEX left to NCCL")
        return {"devices": True, "hcas": hcas, "gid_index": None, "notes": notes}
    chosen = (matching or candidates)[0]
    if not matching:
        notes.append(
            f"no RoCE v2 GID holds fabric IP {fabric_ip}; using {chosen[2]} on {chosen[0]}"
        )
    return {"devices": True, "hcas": hcas, "gid_index": chosen[1], "notes": notes}


def drop_page_cache() -> None:
    """Dirty pages written out, then the clean page cache dropped ("1": pages only; dentries
    and inodes stay, they are small and a composed snapshot's thousands of links reuse them)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as control:
        control.write("1\n")


def parse_compute_apps(text: str) -> list[dict[str, Any]]:
    """The rows of `nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv`:
    a header, then `1234, /usr/bin/python3, 6265 MiB` per process (`[N/A]` where the driver
    does not count a process's memory, as on unified memory). A name may hold ", ": the pid is
    the first field and the memory the last."""
    processes = []
    for line in text.splitlines():
        fields = line.strip().split(", ")
        if len(fields) < 3 or not fields[0].isdigit():
            continue
        amount, _, unit = fields[-1].partition(" ")
        used = int(amount) * (1 << 20) if amount.isdigit() and unit == "MiB" else None
        processes.append(
            {"pid": int(fields[0]), "name": ", ".join(fields[1:-1]), "used_bytes": used}
        )
    return processes


def gpu_processes() -> dict[str, Any]:
    """The GPU's compute processes, or why they could not be listed."""
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return {"checked": False, "reason": "nvidia-smi is not installed on this node"}
    try:
        completed = subprocess.run(
            [
                "nvidia-smi",
                "--query-compute-apps=pid,process_name,used_memory",
                "--format=csv",
            ],
            capture_output=True,
            timeout=DOCKER_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"checked": False, "reason": f"nvidia-smi did not answer in {DOCKER_TIMEOUT_S} s"}
    if completed.returncode != 0:
        error = completed.stderr.decode(errors="replace").strip()[-200:]
        return {"checked": False, "reason": f"nvidia-smi exited {completed.returncode}: {error}"}
    return {"checked": True, "processes": parse_compute_apps(completed.stdout.decode())}


def check_memory(request: dict[str, Any], meminfo: str = "/proc/meminfo") -> dict[str, Any]:
    """The node's memory, the page cache dropped first when it stands between the free memory
    and what the engine needs: only on unified memory, where the GPU driver counts the page
    cache as used (docs/field.md#memory-fit), and only where the inventory allows it."""
    facts = memory_facts(read_meminfo(meminfo))
    answer: dict[str, Any] = {"memory": facts, "page_cache_dropped": False}
    short = facts["free"] < request["required_free_bytes"]
    if request["unified_memory"] and short and request["drop_page_cache"] and facts["page_cache"]:
        answer["memory_before_drop"] = facts
        try:
            drop_page_cache()
            answer["page_cache_dropped"] = True
        except OSError as error:
            answer["page_cache_error"] = str(error)
        answer["memory"] = memory_facts(read_meminfo(meminfo))
    return answer


def preflight(request: dict[str, Any]) -> dict[str, Any]:
    answer = docker_engine().facts(request["image"], request["stale_label"])
    for path in request["create"]:
        os.makedirs(path, exist_ok=True)
    answer["missing_paths"] = [path for path in request["paths"] if not os.path.exists(path)]
    answer.update(check_memory(request))
    answer["gpu_processes"] = gpu_processes()
    answer["gpus"] = gpu_count() if request["gpus"] else None
    if request["detect_rdma"]:
        answer["rdma"] = detect_roce(SYSFS_INFINIBAND, request["fabric_ip"])
    return answer


def reach(url: str) -> str | None:
    """None when a TCP connection to the URL's host and port opens, else why it did not."""
    scheme, _, rest = url.rpartition("://")
    netloc = rest.split("/", 1)[0]
    host, colon, port = netloc.rpartition(":")
    if not colon or "]" in port:  # no port: an IPv6 literal's colons are inside its brackets
        host, port = netloc, ""
    try:
        address = (host.strip("[]"), int(port) if port else 443 if scheme == "https" else 80)
        socket.create_connection(address, timeout=REACH_TIMEOUT_S).close()
    except (OSError, ValueError) as error:
        return str(error)
    return None


def main(argv: list[str]) -> int:
    mode, request = argv[0], json.loads(argv[1])
    if mode == "image":
        facts = docker_engine().facts(request["image"], None)
        answer = {"docker": facts["docker"], "image": facts["image"]}
    elif mode == "preflight":
        answer = preflight(request)
    elif mode == "look":
        answer = docker_engine().facts(request["image"], request["stale_label"])
    elif mode == "reach":
        answer = {url: reach(url) for url in request["urls"]}
    else:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    print(json.dumps(answer))
    return 0
