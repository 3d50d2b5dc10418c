"""The node's network as vLLM, NCCL and gloo see it, and the multi-node rendezvous.

The rendezvous stands in for torch.distributed's TCP store: the head listens on
master-addr:master-port, each headless worker connects (retrying, as torch's client does) and
registers its node rank; the head's engine starts once every worker has loaded its weights.
Messages are JSON lines.
"""

from __future__ import annotations

import contextlib
import errno
import json
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

try:
    from lab.engine.standin_log import VLLM_VERSION, EngineFatal, Logger
except ImportError:  # copied flat into the engine image
    from standin_log import VLLM_VERSION, EngineFatal, Logger  # type: ignore[no-redef, import-not-found]

NCCL_VERSION = "2.27.7"
CONNECT_RETRY_S = 0.1


def interface_names() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def nccl_interfaces_matching(spec: str, names: list[str]) -> list[str]:
    """NCCL_SOCKET_IFNAME semantics: comma-separated prefixes, `^` excludes, `=` is exact."""
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    if exact:
        body = body[1:]
    wanted = [part for part in body.split(",") if part]

    def matches(name: str) -> bool:
        return any(name == part if exact else name.startswith(part) for part in wanted)

    return [name for name in names if matches(name) != exclude]


def check_node_network(env: Mapping[str, str]) -> None:
    """VLLM_HOST_IP must be an address of this host, the socket interfaces must exist."""
    host_ip = env.get("VLLM_HOST_IP")
    if host_ip:
        probe = socket.socket(socket.AF_INET6 if ":" in host_ip else socket.AF_INET)
        try:
            probe.bind((host_ip, 0))
        except OSError as exc:
            raise EngineFatal(
                [
                    f"VLLM_HOST_IP={host_ip} is not an address of this host",
                    "torch.distributed.DistNetworkError: The server socket has failed to bind to "
                    f"[{host_ip}]:0 (errno: {exc.errno} - {exc.strerror}).",
                ]
            ) from exc
        finally:
            probe.close()
    names = interface_names()
    nccl_spec = env.get("NCCL_SOCKET_IFNAME")
    if nccl_spec and not nccl_interfaces_matching(nccl_spec, names):
        raise EngineFatal(
            [
                f"NCCL WARN Bootstrap : no socket interface found (NCCL_SOCKET_IFNAME={nccl_spec}"
                f", interfaces of this host: {', '.join(names)})",
                "torch.distributed.DistBackendError: NCCL error in: "
                "/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3690, internal error - "
                f"please report this issue to the NCCL developers, NCCL version {NCCL_VERSION}",
                "ncclInternalError: Internal check failed.",
                "Last error:",
                "Bootstrap : no socket interface found",
            ]
        )
    gloo_name = env.get("GLOO_SOCKET_IFNAME")
    if gloo_name and gloo_name not in names:
        raise EngineFatal(
            [
                "RuntimeError: [enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/"
                f"device.cc:85] ifa != nullptr. Unable to find address for: {gloo_name}"
            ]
        )


def _send(sock: socket.socket, message: Mapping[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


@dataclass
class WorkerLink:
    node_rank: int
    host: str
    sock: socket.socket
    loaded: bool = False
    reader: Any = None


@dataclass
class HeadRendezvous:
    """The head's side: accepts workers, checks they match, waits for all to load."""

    addr: str
    port: int
    nnodes: int
    expected: Mapping[str, Any]
    log: Logger
    on_worker_lost: Callable[[int, str], None] = lambda rank, reason: None
    workers: dict[int, WorkerLink] = field(default_factory=dict)
    failure: str | None = None
    failed_worker: WorkerLink | None = None
    ready: bool = False
    closing: bool = False
    _lock: threading.Condition = field(default_factory=threading.Condition)
    _listener: socket.socket | None = None

    def start(self) -> None:
        listener = socket.socket(socket.AF_INET6 if ":" in self.addr else socket.AF_INET)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.addr, self.port))
        except OSError as exc:
            listener.close()
            raise EngineFatal(
                [
                    "torch.distributed.DistNetworkError: The server socket has failed to bind to "
                    f"[{self.addr}]:{self.port} (errno: {exc.errno} - {exc.strerror})."
                ]
            ) from exc
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_worker, args=(sock, peer[0]), daemon=True).start()

    def _serve_worker(self, sock: socket.socket, peer: str) -> None:
        reader = sock.makefile("r", encoding="utf-8")
        try:
            hello = json.loads(reader.readline() or "null")
        except (OSError, json.JSONDecodeError):
            hello = None
        if not isinstance(hello, dict):
            sock.close()
            return
        rank = hello.get("node_rank")
        problem = self._registration_problem(hello)
        if problem:
            _send(sock, {"ok": False, "error": problem})
            sock.close()
            self.log.error("multiproc_executor.py:187", f"rejected node {peer}: {problem}")
            return
        assert isinstance(rank, int)
        link = WorkerLink(rank, peer, sock, reader=reader)
        with self._lock:
            self.workers[rank] = link
            self._lock.notify_all()
        _send(sock, {"ok": True})
        self.log.info(
            "multiproc_executor.py:203",
            f"node rank {rank} ({peer}) joined the process group "
            f"({len(self.workers) + 1}/{self.nnodes} nodes)",
        )
        self._follow_worker(link)

    def _registration_problem(self, hello: Mapping[str, Any]) -> str | None:
        rank = hello.get("node_rank")
        if not isinstance(rank, int) or not 1 <= rank < self.nnodes:
            return f"node rank {rank!r} is not in 1..{self.nnodes - 1} (--nnodes {self.nnodes})"
        for key, value in self.expected.items():
            if hello.get(key) != value:
                return (
                    f"node rank {rank} runs with {key}={hello.get(key)!r} but the head has "
                    f"{key}={value!r}; every node must run the same command"
                )
        with self._lock:
            if rank in self.workers:
                return f"node rank {rank} is already taken by {self.workers[rank].host}"
        return None

    def _follow_worker(self, link: WorkerLink) -> None:
        while True:
            try:
                line = link.reader.readline()
            except OSError:
                line = ""
            if not line:
                break
            message = json.loads(line)
            with self._lock:
                if message.get("status") == "loaded":
                    link.loaded = True
                elif message.get("status") == "failed":
                    self.failure = f"node rank {link.node_rank}: {message.get('error')}"
                    self.failed_worker = link
                self._lock.notify_all()
        with self._lock:
            was_ready = self.ready
            if not was_ready and self.failure is None:
                self.failure = f"node rank {link.node_rank} ({link.host}) closed its connection"
                self.failed_worker = link
            self.workers.pop(link.node_rank, None)
            self._lock.notify_all()
        if was_ready and not self.closing:
            self.on_worker_lost(link.node_rank, link.host)

    def _startup_failure(self) -> EngineFatal:
        """A worker failed before ready: rank 0's gloo pair sees its peer go first (as in vLLM
        0.32, which names the worker only by its address), then the stand-in's own account."""
        lines = [f"ERROR: worker failed during startup: {self.failure}"]
        if self.failed_worker is not None:
            peer = self.failed_worker
            lines.insert(0, gloo_peer_closed_line(peer.host, peer.node_rank))
        return EngineFatal(lines)

    def wait_all_joined(self, deadline: float, timeout_s: float) -> None:
        """Until every worker has joined (vLLM's head waits in init_process_group, silent)."""
        with self._lock:
            while len(self.workers) < self.nnodes - 1:
                if self.failure is not None:
                    raise self._startup_failure()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineFatal([engine_timeout_line(timeout_s)], engine_core=False)
                self._lock.wait(min(remaining, 0.5))

    def wait_all_loaded(self, deadline: float, timeout_s: float) -> None:
        """Until every worker has loaded; vLLM's engine-core timeout once `deadline` passes."""
        with self._lock:
            while True:
                if self.failure is not None:
                    raise self._startup_failure()
                loaded = sum(1 for link in self.workers.values() if link.loaded)
                if loaded == self.nnodes - 1:
                    self.ready = True
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineFatal([engine_timeout_line(timeout_s)], engine_core=False)
                self._lock.wait(min(remaining, 0.5))
        for link in list(self.workers.values()):
            _send(link.sock, {"status": "ready"})

    def close(self) -> None:
        with self._lock:
            self.closing = True
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            links = list(self.workers.values())
        for link in links:
            with contextlib.suppress(OSError):
                _send(link.sock, {"status": "shutdown"})
                link.sock.close()


@dataclass
class WorkerRendezvous:
    """A headless worker's side of the rendezvous."""

    addr: str
    port: int
    sock: socket.socket
    reader: Any

    @classmethod
    def connect(
        cls, addr: str, port: int, timeout_s: float, hello: Mapping[str, Any]
    ) -> WorkerRendezvous:
        """Connect and register, retrying refused or unreachable attempts until timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineFatal(
                    [
                        "torch.distributed.DistNetworkError: The client socket has timed out after "
                        f"{int(timeout_s * 1000)}ms while trying to connect to ({addr}, {port})."
                    ],
                    engine_core=False,
                )
            try:
                sock = socket.create_connection((addr, port), timeout=min(remaining, 2.0))
                break
            except OSError as exc:
                if exc.errno not in (None, *_RETRYABLE) and not isinstance(exc, TimeoutError):
                    raise EngineFatal(
                        [
                            "torch.distributed.DistNetworkError: failed to connect to "
                            f"({addr}, {port}): {exc}"
                        ],
                        engine_core=False,
                    ) from exc
                time.sleep(min(CONNECT_RETRY_S, max(remaining, 0)))
        sock.settimeout(None)
        reader = sock.makefile("r", encoding="utf-8")
        _send(sock, hello)
        reply = json.loads(reader.readline() or "null")
        if not isinstance(reply, dict) or not reply.get("ok"):
            error = reply.get("error") if isinstance(reply, dict) else "connection closed"
            raise EngineFatal(
                [f"RuntimeError: the head at {addr}:{port} refused this node: {error}"],
                engine_core=False,
            )
        return cls(addr, port, sock, reader)

    def report_loaded(self) -> None:
        _send(self.sock, {"status": "loaded"})

    def report_failed(self, error: str) -> None:
        with contextlib.suppress(OSError):
            _send(self.sock, {"status": "failed", "error": error})

    def next_status(self) -> str:
        """The head's next message ('ready', 'shutdown'), or '' once the connection is gone.

        TimeoutError when the socket has a timeout and nothing came.
        """
        try:
            line = self.reader.readline()
        except TimeoutError:
            raise
        except OSError:
            return ""
        if not line:
            return ""
        return str(json.loads(line).get("status", ""))

    def close(self) -> None:
        self.sock.close()


_RETRYABLE = (
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ETIMEDOUT,
    errno.EADDRNOTAVAIL,
)


def headless_line(addr: str, port: int) -> str:
    return (
        f"Launching vLLM (v{VLLM_VERSION}) headless multiproc executor, with head node address "
        f"{addr}:{port} for torch.distributed process group."
    )


def gloo_peer_closed_line(host: str, node_rank: int) -> str:
    """What TP rank 0's gloo pair raises when the process of a peer node is gone."""
    return (
        "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"
        f" Connection closed by peer [{host}]:{29500 + node_rank}. This is typically caused by a"
        " remote worker crashing. Check the logs of the remote worker before reporting an error."
    )


def engine_timeout_line(timeout_s: float) -> str:
    return (
        "TimeoutError: Timed out waiting for engine core processes to start. This is often "
        f"caused by slow weight loading for large models. Waited {timeout_s:g}s (configured by "
        "VLLM_ENGINE_READY_TIMEOUT_S). To increase the timeout, set the environment variable "
        "VLLM_ENGINE_READY_TIMEOUT_S."
    )
