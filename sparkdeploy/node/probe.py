"""Facts about one node in one SSH round trip: docker, an image, disk, memory, GPUs, RDMA.

Standard library only: sparkdeploy.remote.node_script ships this module to the node, whose python3
runs `main([mode, request_json])`; the last stdout line is the JSON answer. Modes:

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

docker is asked through its Engine API on the unix socket the docker CLI would use: a few
milliseconds a question, where each start of the docker CLI (a Go binary) costs ~25 ms of CPU,
which a warm redeploy of many nodes on few cores felt. Where docker is configured to reach
another daemon (a non-unix DOCKER_HOST, a docker context) the docker CLI is asked instead, all
questions at once.

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

# The node pays for each import at every start, so typing (and subprocess, which only the CLI
# fallback and nvidia-smi need) are not imported there; mypy reads the annotations.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess
    from typing import Any

DOCKER_TIMEOUT_S = 30
REACH_TIMEOUT_S = 5
DEFAULT_DOCKER_SOCKET = "/var/run/docker.sock"
SYSFS_INFINIBAND = "/sys/class/infiniband"
_IPV4_MAPPED_PREFIX = "0" * 20 + "ffff"
_CLI_MISSING = "the docker CLI is not installed on this node"
_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


def docker_socket(environ: dict[str, str], home: str) -> str | None:
    """The unix socket the docker CLI would talk to; None when it is configured to reach
    another daemon (a non-unix DOCKER_HOST, a docker context), which only the CLI can do."""
    host = environ.get("DOCKER_HOST")
    if host:
        return host.removeprefix("unix://") if host.startswith("unix://") else None
    context = environ.get("DOCKER_CONTEXT")
    if context is None:
        config_dir = environ.get("DOCKER_CONFIG") or os.path.join(home, ".docker")
        try:
            with open(os.path.join(config_dir, "config.json")) as config:
                context = json.load(config).get("currentContext")
        except (OSError, ValueError, AttributeError):
            context = None
    return DEFAULT_DOCKER_SOCKET if context in (None, "", "default") else None


def quote(text: str, safe: str = "") -> str:
    """Percent-encoding for a URL path or query value (urllib.parse's, without its import)."""
    allowed = _UNRESERVED | frozenset(safe.encode())
    return "".join(chr(byte) if byte in allowed else f"%{byte:02X}" for byte in text.encode())


def docker_facts_of(info: dict[str, Any]) -> dict[str, Any]:
    root = info.get("DockerRootDir") or "/var/lib/docker"
    mirrors = (info.get("RegistryConfig") or {}).get("Mirrors") or []
    return {
        "version": info.get("ServerVersion"),
        "root": root,
        "free_bytes": free_bytes(root),
        "mirrors": mirrors,
    }


def image_facts_of(inspected: dict[str, Any]) -> dict[str, Any]:
    labels = (inspected.get("Config") or {}).get("Labels") or {}
    layers = (inspected.get("RootFS") or {}).get("Layers") or []
    return {
        "id": inspected["Id"],
        "size": inspected.get("Size", 0),
        "layers": len(layers),
        "labels": labels,
    }


class EngineApi:
    """Requests to docker's Engine API on a unix socket. HTTP/1.0: one connection a request,
    the answer ends where the daemon closes it (no chunked bodies, no http.client to import on
    the node). The lab uses it too, on each node's socket from the host."""

    def __init__(self, socket_path: str, *, timeout: float = DOCKER_TIMEOUT_S) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    def request(self, method: str, path: str) -> tuple[int, bytes]:
        """(HTTP status, body); OSError when the daemon cannot be reached or answers
        something that is not HTTP."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(self.timeout)
            connection.connect(self.socket_path)
            connection.sendall(f"{method} {path} HTTP/1.0\r\nHost: docker\r\n\r\n".encode())
            chunks = []
            while chunk := connection.recv(65536):
                chunks.append(chunk)
        head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0].split()
        if len(status) < 2 or not status[1].isdigit():
            raise OSError(f"{self.socket_path} answered {head[:80]!r}, not HTTP")
        return int(status[1]), body

    def get(self, path: str) -> tuple[int, Any]:
        """(HTTP status, the JSON body or None); OSError as for request()."""
        status, body = self.request("GET", path)
        try:
            return status, json.loads(body) if body.strip() else None
        except ValueError as error:
            raise OSError(f"{self.socket_path} answered {path} with no JSON: {error}") from error

    def facts(self, image: str, stale_label: str | None) -> dict[str, Any]:
        """docker's facts, the image's (None when absent) and the labelled containers' IDs."""
        if shutil.which("docker") is None:
            # Our containers are started with the CLI, so a node without it cannot boot them.
            return _docker_down(_CLI_MISSING)
        try:
            info = self._expect(200, "/info", dict)
            status, inspected = self.get(f"/images/{quote(image, safe='/:@')}/json")
            stale: list[str] = []
            foreign: list[dict[str, str]] = []
            if stale_label:
                filters = quote(json.dumps({"label": [stale_label]}))
                listed = self._expect(200, f"/containers/json?all=1&filters={filters}", list)
                stale = [entry["Id"] for entry in listed]
                running = self._expect(200, "/containers/json", list)
                foreign = [
                    {
                        "name": (entry.get("Names") or ["?"])[0].lstrip("/"),
                        "image": str(entry.get("Image", "?")),
                    }
                    for entry in running
                    if stale_label not in (entry.get("Labels") or {})
                ]
        except OSError as error:
            return _docker_down(
                f"Cannot connect to the Docker daemon at unix://{self.socket_path} ({error})."
                " Is the docker daemon running?"
            )
        except _BadAnswer as error:
            return _docker_down(str(error))
        found = status == 200 and isinstance(inspected, dict)
        return {
            "docker": docker_facts_of(info),
            "image": image_facts_of(inspected) if found else None,
            "stale_containers": stale,
            "foreign_containers": foreign,
        }

    def _expect(self, wanted: int, path: str, kind: type) -> Any:
        status, body = self.get(path)
        if status != wanted or not isinstance(body, kind):
            message = body.get("message", body) if isinstance(body, dict) else body
            raise _BadAnswer(f"docker answered GET {path} with {status}: {message}")
        return body


class _BadAnswer(Exception):
    pass


def _docker_down(error: str) -> dict[str, Any]:
    return {
        "docker": {"error": error},
        "image": None,
        "stale_containers": [],
        "foreign_containers": [],
    }


class DockerCli:
    """The same questions to the docker CLI, all started at once: each CLI spends most of its
    time starting up."""

    def facts(self, image: str, stale_label: str | None) -> dict[str, Any]:
        import subprocess

        questions = {
            "info": ["info", "--format", "{{json .}}"],
            "image": ["image", "inspect", "--format", "{{json .}}", image],
        }
        if stale_label:
            questions["stale"] = [
                "ps",
                "-a",
                "-q",
                "--no-trunc",
                "--filter",
                f"label={stale_label}",
            ]
            questions["running"] = ["ps", "--format", "{{json .}}"]
        running: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for name, args in questions.items():
                running[name] = subprocess.Popen(
                    ["docker", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
                )
        except FileNotFoundError:
            for process in running.values():
                process.kill()
                process.communicate()
            return _docker_down(_CLI_MISSING)
        answers = {name: _answer(process, questions[name]) for name, process in running.items()}
        code, out, err = answers["info"]
        if code != 0:
            error = err or f"`docker info` exited {code}"
        else:
            info = json.loads(out)
            error = "; ".join(info.get("ServerErrors") or [])
        if error:
            return _docker_down(error)
        image_code, image_out, _ = answers["image"]
        stale_code, stale_out, _ = answers.get("stale", (0, "", ""))
        running_code, running_out, _ = answers.get("running", (0, "", ""))
        return {
            "docker": docker_facts_of(info),
            "image": image_facts_of(json.loads(image_out)) if image_code == 0 else None,
            "stale_containers": stale_out.split() if stale_code == 0 else [],
            "foreign_containers": (
                _foreign_of_cli(running_out, stale_label)
                if running_code == 0 and stale_label
                else []
            ),
        }


def _foreign_of_cli(listing: str, our_label: str) -> list[dict[str, str]]:
    """The running containers without `our_label` in `docker ps --format '{{json .}}'` lines
    (whose Labels are one "k=v,k=v" string)."""
    foreign = []
    for line in listing.splitlines():
        entry = json.loads(line)
        keys = {item.split("=", 1)[0] for item in str(entry.get("Labels", "")).split(",")}
        if our_label not in keys:
            foreign.append(
                {"name": str(entry.get("Names", "?")), "image": str(entry.get("Image", "?"))}
            )
    return foreign


def _answer(process: subprocess.Popen[bytes], args: list[str]) -> tuple[int, str, str]:
    import subprocess

    try:
        out, err = process.communicate(timeout=DOCKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return 124, "", f"`docker {' '.join(args)}` did not answer within {DOCKER_TIMEOUT_S} s"
    return (
        process.returncode,
        out.decode("utf-8", "replace"),
        err.decode("utf-8", "replace").strip(),
    )


def docker_engine() -> EngineApi | DockerCli:
    socket_path = docker_socket(dict(os.environ), os.path.expanduser("~"))
    return DockerCli() if socket_path is None else EngineApi(socket_path)


def free_bytes(path: str) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


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
