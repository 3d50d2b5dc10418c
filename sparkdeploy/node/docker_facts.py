"""docker's facts ON a node, for sparkdeploy.node.probe (standard library only): docker itself,
an image, the containers with our label and the other running ones.

docker is asked through its Engine API on the unix socket the docker CLI would use: a few
milliseconds a question, where each start of the docker CLI (a Go binary) costs ~25 ms of CPU,
which a warm redeploy of many nodes on few cores felt. Where docker is configured to reach
another daemon (a non-unix DOCKER_HOST, a docker context) the docker CLI is asked instead, all
questions at once.
"""

from __future__ import annotations

import json
import os
import shutil
import socket

# The node pays for each import at every start, so typing (and subprocess, which only the CLI
# fallback needs) are not imported there; mypy reads the annotations.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess
    from typing import Any

DOCKER_TIMEOUT_S = 30
DEFAULT_DOCKER_SOCKET = "/var/run/docker.sock"
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
