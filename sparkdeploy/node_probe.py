"""Facts about one node in one SSH round trip: docker, an image, disk, memory, GPUs, RDMA.

Standard library only: sparkdeploy.node_script ships this module to the node, whose python3
runs `main([mode, request_json])`; the last stdout line is the JSON answer. Modes:

- `image`: {"image"} -> the image's id/size/labels (or null), docker's root dir and its free bytes.
- `preflight`: {"image", "paths", "gpus", "fabric_ip", "detect_rdma", "drop_page_cache",
  "stale_label"} -> the above plus missing paths, MemAvailable, GPU count, RDMA facts, whether the
  cache was dropped, and the IDs of the containers labelled `stale_label` (running or not).

RDMA facts follow FACTS.md: an HCA is used when a port is ACTIVE on an Ethernet link layer (RoCE);
NCCL_IB_GID_INDEX is the index of a RoCE v2 GID holding an IPv4-mapped address, preferably the
node's fabric IP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

DOCKER_TIMEOUT_S = 30
SYSFS_INFINIBAND = "/sys/class/infiniband"
_IPV4_MAPPED_PREFIX = "0" * 20 + "ffff"


def _docker(args: list[str]) -> tuple[int, str, str]:
    try:
        completed = subprocess.run(
            ["docker", *args], capture_output=True, timeout=DOCKER_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        return 127, "", "the docker CLI is not installed on this node"
    except subprocess.TimeoutExpired:
        return 124, "", f"`docker {' '.join(args)}` did not answer within {DOCKER_TIMEOUT_S} s"
    return (
        completed.returncode,
        completed.stdout.decode("utf-8", "replace"),
        completed.stderr.decode("utf-8", "replace").strip(),
    )


def image_facts(image: str) -> dict[str, Any] | None:
    code, out, _ = _docker(["image", "inspect", "--format", "{{json .}}", image])
    if code != 0:
        return None
    inspected = json.loads(out)
    labels = (inspected.get("Config") or {}).get("Labels") or {}
    layers = (inspected.get("RootFS") or {}).get("Layers") or []
    return {
        "id": inspected["Id"],
        "size": inspected.get("Size", 0),
        "layers": len(layers),
        "labels": labels,
    }


def docker_facts() -> dict[str, Any]:
    """docker's version and root dir, or `error` when the daemon does not answer."""
    code, out, err = _docker(["info", "--format", "{{json .}}"])
    if code != 0:
        return {"error": err or f"`docker info` exited {code}"}
    info = json.loads(out)
    if info.get("ServerErrors"):
        return {"error": "; ".join(info["ServerErrors"])}
    root = info.get("DockerRootDir") or "/var/lib/docker"
    return {"version": info.get("ServerVersion"), "root": root, "free_bytes": free_bytes(root)}


def free_bytes(path: str) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    with open(meminfo) as lines:
        for line in lines:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo} has no MemAvailable line")


def gpu_count() -> int | None:
    """GPUs nvidia-smi lists; None when nvidia-smi is missing or fails."""
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
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as control:
        control.write("3\n")


def labelled_containers(label: str) -> list[str]:
    """IDs of every container (running or not) labelled `label`; [] when docker does not answer
    (docker_facts reports that)."""
    code, out, _ = _docker(["ps", "-a", "-q", "--no-trunc", "--filter", f"label={label}"])
    return out.split() if code == 0 else []


def preflight(request: dict[str, Any]) -> dict[str, Any]:
    # The docker CLI calls at once: each spends most of its time starting up.
    with ThreadPoolExecutor(max_workers=3) as pool:
        docker = pool.submit(docker_facts)
        image = pool.submit(image_facts, request["image"])
        stale = pool.submit(labelled_containers, request["stale_label"])
    answer: dict[str, Any] = {"docker": docker.result()}
    docker_up = "error" not in answer["docker"]
    answer["image"] = image.result() if docker_up else None
    answer["stale_containers"] = stale.result() if docker_up else []
    answer["missing_paths"] = [path for path in request["paths"] if not os.path.exists(path)]
    answer["page_cache_dropped"] = False
    if request["drop_page_cache"]:
        try:
            drop_page_cache()
            answer["page_cache_dropped"] = True
        except OSError as error:
            answer["page_cache_error"] = str(error)
    answer["mem_available_bytes"] = mem_available_bytes()
    answer["gpus"] = gpu_count() if request["gpus"] else None
    if request["detect_rdma"]:
        answer["rdma"] = detect_roce(SYSFS_INFINIBAND, request["fabric_ip"])
    return answer


def main(argv: list[str]) -> int:
    mode, request = argv[0], json.loads(argv[1])
    if mode == "image":
        with ThreadPoolExecutor(max_workers=2) as pool:
            docker = pool.submit(docker_facts)
            image = pool.submit(image_facts, request["image"])
        answer = {
            "docker": docker.result(),
            "image": None if "error" in docker.result() else image.result(),
        }
    elif mode == "preflight":
        answer = preflight(request)
    else:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    print(json.dumps(answer))
    return 0
