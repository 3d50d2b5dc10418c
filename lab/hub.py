"""A local Hugging Face hub for the lab and the tests: what huggingface_hub 2.4's
snapshot_download and hf_hub_download call, served from a directory, answered as the real hub
answers (docs/field.md, "The Hugging Face hub"), with fault switches.

Repos live at repos_dir/<org>/<name>/ (lab.tinymodel writes them). Each has one revision,
`main`, whose commit sha is derived from the files' content; a sibling file
repos_dir/<org>/<name>.gated (one token a line) makes the repo gated. Two origins, as on the
real hub: the hub itself and a storage host at another address that holds the LFS files.

    GET  /api/models/{repo}[/revision/{rev}][?blobs=true]   sha and siblings
    GET  /api/models/{repo}/tree/{rev}[/{path}]?recursive=  entries, paginated by a Link header
    HEAD /{repo}/resolve/{rev}/{path}                       X-Repo-Commit, ETag, sizes
    GET  /{repo}/resolve/{rev}/{path}                       small files: the bytes (Range: 206)
                                                            LFS files: 302 to a signed storage
                                                            URL, X-Linked-Size, X-Linked-Etag
    GET  <storage>/lfs/{repo}/{sha256}?expires=&signature=  the LFS bytes (Range: 206); no token

Errors carry X-Error-Code and X-Error-Message: a gated repo is 401 GatedRepo without a token and
403 GatedRepo with one that is not on its list; a missing repo is 401 RepoNotFound anonymously
and 404 with a token; a missing revision or file is 404 RevisionNotFound or EntryNotFound; a
token not shaped like a Hugging Face token (`hf_...`) is 401 "Invalid credentials in
Authorization header" on every endpoint.

Lab control: GET/POST /_lab/faults (JSON: fail_next + status + retry_after, cut_next_file, slow,
reset) and GET/POST /_lab/stats (requests, bytes served, and per origin the Authorization
headers received as fingerprints; POST {"reset": true} zeroes them); HubControl calls them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".onnx")
LFS_MIN_BYTES = 10 * 1024 * 1024
CACHE_DIR_NAME = ".hub-cache"  # under repos_dir; org names never start with a dot
HASH_CHUNK_BYTES = 8 * 1024 * 1024
SEND_CHUNK_BYTES = 16 * 1024 * 1024
# Idle keep-alive connections are closed after this, so no handler thread waits forever.
CONNECTION_IDLE_TIMEOUT_S = 60.0
REQUEST_LOG_LENGTH = 10_000
# How long a storage URL the hub hands out stays valid (the real hub's are signed for about an
# hour).
STORAGE_URL_LIFETIME_S = 3600
HUB = "hub"
STORAGE = "storage"
# The quota a 429 announces, per bucket ("api" for /api/, "resolvers" for /resolve/) over a
# 5-minute window, in the real hub's header form (https://huggingface.co/docs/hub/rate-limits).
RATE_LIMIT_QUOTA = 1000
RATE_LIMIT_WINDOW_S = 300
DEFAULT_RETRY_AFTER_S = 1


@dataclass(frozen=True)
class HubFile:
    """One file of a repo as the hub describes it."""

    path: str
    size: int
    blob_id: str  # git blob sha1 (of the LFS pointer for LFS files)
    sha256: str | None  # LFS files only

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id

    def lfs_pointer(self) -> bytes:
        return (
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\n"
            f"size {self.size}\n"
        ).encode()

    def tree_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "type": "file",
            "oid": self.blob_id,
            "size": self.size,
            "path": self.path,
        }
        if self.sha256 is not None:
            entry["lfs"] = {
                "oid": self.sha256,
                "size": self.size,
                "pointerSize": len(self.lfs_pointer()),
            }
        return entry

    def sibling(self) -> dict[str, Any]:
        sibling: dict[str, Any] = {
            "rfilename": self.path,
            "size": self.size,
            "blobId": self.blob_id,
        }
        if self.sha256 is not None:
            sibling["lfs"] = {
                "size": self.size,
                "sha256": self.sha256,
                "pointerSize": len(self.lfs_pointer()),
            }
        return sibling


@dataclass(frozen=True)
class RepoState:
    """A repo's single revision: its commit sha and files, sorted by path."""

    repo_id: str
    root: Path
    sha: str
    files: dict[str, HubFile]
    last_modified: float
    gated_tokens: frozenset[str] | None

    def directories(self) -> list[str]:
        """Every directory that holds a file, at any depth."""
        found: set[str] = set()
        for path in self.files:
            parts = path.split("/")[:-1]
            found.update("/".join(parts[: depth + 1]) for depth in range(len(parts)))
        return sorted(found)


def is_lfs(path: str, size: int) -> bool:
    return path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_BYTES


class RepoIndex:
    """Repo states with the files' digests cached (memory and repos_dir/.hub-cache).

    A digest is reused while the file's size, mtime and inode are unchanged, so a multi-GiB
    repo is hashed once, not on every request.
    """

    def __init__(self, repos_dir: Path) -> None:
        self.repos_dir = repos_dir
        self._lock = threading.Lock()
        self._repo_locks: dict[str, threading.Lock] = {}

    def state(
        self, repo_id: str, known_sha256: Mapping[str, str] | None = None
    ) -> RepoState | None:
        """The repo's state now, or None if there is no such repo.

        known_sha256 gives the sha256 of LFS files by path, from whoever just wrote them, so
        they need not be read again.
        """
        org, _, name = repo_id.partition("/")
        if not org or not name or org.startswith(".") or name.startswith(".") or "/" in name:
            return None
        root = self.repos_dir / org / name
        if not root.is_dir():
            return None
        with self._lock:
            repo_lock = self._repo_locks.setdefault(repo_id, threading.Lock())
        with repo_lock:
            return self._build(repo_id, root, known_sha256 or {})

    def _build(self, repo_id: str, root: Path, known_sha256: Mapping[str, str]) -> RepoState:
        cache_path = self.repos_dir / CACHE_DIR_NAME / f"{repo_id}.json"
        cache = _read_json(cache_path)
        files: dict[str, HubFile] = {}
        fresh_cache: dict[str, Any] = {}
        last_modified = 0.0
        for path in sorted(_walk_files(root)):
            relative = path.relative_to(root).as_posix()
            stat = path.stat()
            identity = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
            cached = cache.get(relative)
            if isinstance(cached, dict) and cached.get("identity") == identity:
                entry = cached
            elif relative in known_sha256 and is_lfs(relative, stat.st_size):
                entry = {
                    "identity": identity,
                    **_lfs_digests(relative, stat.st_size, known_sha256[relative]),
                }
            else:
                entry = {"identity": identity, **_digests(path, relative, stat.st_size)}
            fresh_cache[relative] = entry
            files[relative] = HubFile(relative, stat.st_size, entry["blob_id"], entry["sha256"])
            last_modified = max(last_modified, stat.st_mtime)
        if fresh_cache != cache:
            _write_json(cache_path, fresh_cache)
        listing = "".join(f"{f.path}\0{f.etag}\0" for f in files.values())
        sha = hashlib.sha1(f"{repo_id}\0{listing}".encode()).hexdigest()
        gate = root.parent / f"{root.name}.gated"
        gated_tokens = (
            frozenset(line.strip() for line in gate.read_text().splitlines() if line.strip())
            if gate.is_file()
            else None
        )
        return RepoState(repo_id, root, sha, files, last_modified, gated_tokens)


def _walk_files(root: Path) -> Iterator[Path]:
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d != ".git"]
        for name in names:
            yield Path(directory) / name


def _digests(path: Path, relative: str, size: int) -> dict[str, Any]:
    lfs = is_lfs(relative, size)
    digest = hashlib.sha256() if lfs else hashlib.sha1(f"blob {size}\0".encode())
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    if not lfs:
        return {"blob_id": digest.hexdigest(), "sha256": None}
    return _lfs_digests(relative, size, digest.hexdigest())


def _lfs_digests(relative: str, size: int, sha256: str) -> dict[str, Any]:
    pointer = HubFile(relative, size, "", sha256).lfs_pointer()
    blob_id = hashlib.sha1(f"blob {len(pointer)}\0".encode() + pointer).hexdigest()
    return {"blob_id": blob_id, "sha256": sha256}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    temporary.write_text(json.dumps(data))
    temporary.replace(path)


def index_repo(
    repos_dir: str | os.PathLike[str],
    repo_id: str,
    known_sha256: Mapping[str, str] | None = None,
) -> RepoState:
    """Put a repo's digests in the hub's cache now, so its first request is fast."""
    state = RepoIndex(Path(repos_dir)).state(repo_id, known_sha256)
    if state is None:
        raise FileNotFoundError(f"no repo {repo_id} under {repos_dir} (expected {repo_id}/ there)")
    return state


def fingerprint(authorization: str) -> str:
    """How the request log names an Authorization header: a digest, never the token itself."""
    return hashlib.sha256(authorization.encode()).hexdigest()[:16]


@dataclass
class RequestRecord:
    """One request; status and bytes_sent are filled in before the client can see them.

    `origin` is the address it reached (HUB or STORAGE); `authorization` the fingerprint of its
    Authorization header, if it had one.
    """

    method: str
    path: str
    range: str | None
    authorized: bool
    origin: str = HUB
    authorization: str | None = None
    status: int = 0
    bytes_sent: int = 0


@dataclass
class Faults:
    fail_remaining: int = 0
    fail_status: int = 503
    # Sent as Retry-After with the injected failures (a 429 always has one).
    retry_after_s: int | None = None
    cut_after_bytes: int | None = None
    slow_bytes_per_s: int | None = None


class HubServer:
    """The lab hub in threads of this process (or, via main(), as its own process): the hub's
    address and the storage host's, by default the same host on another port."""

    def __init__(
        self,
        repos_dir: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        page_size: int = 1000,
        storage_host: str | None = None,
        storage_port: int = 0,
    ) -> None:
        self.repos_dir = Path(repos_dir)
        self.index = RepoIndex(self.repos_dir)
        self.page_size = page_size
        self._addresses = {HUB: (host, port), STORAGE: (storage_host or host, storage_port)}
        self._signing_key = os.urandom(32)
        self._faults = Faults()
        self._lock = threading.Lock()
        self._log: deque[RequestRecord] = deque(maxlen=REQUEST_LOG_LENGTH)
        self._request_count = 0
        self._bytes_served = 0
        self._servers: dict[str, _HubHTTPServer] = {}
        self._threads: list[threading.Thread] = []

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> HubServer:
        if self._servers:
            return self
        try:
            for origin, address in self._addresses.items():
                httpd = _HubHTTPServer(address, _HubHandler)
                httpd.hub = self
                httpd.origin = origin
                self._servers[origin] = httpd
        except OSError:
            self._close_servers()
            raise
        for origin, httpd in self._servers.items():
            thread = threading.Thread(
                target=httpd.serve_forever,
                kwargs={"poll_interval": 0.1},
                name=f"lab-{origin}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        for httpd in self._servers.values():
            httpd.shutdown()
            httpd.close_connections()
        self._close_servers()
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads.clear()

    def _close_servers(self) -> None:
        for httpd in self._servers.values():
            httpd.server_close()
        self._servers.clear()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The hub's address: the endpoint clients are given."""
        return self._url_of(HUB)

    @property
    def storage_url(self) -> str:
        """The storage host's address, where the hub redirects LFS downloads."""
        return self._url_of(STORAGE)

    def _url_of(self, origin: str) -> str:
        httpd = self._servers.get(origin)
        if httpd is None:
            raise RuntimeError("the lab hub is not started: call start() first")
        host, port = httpd.socket.getsockname()[:2]
        return f"http://{host}:{port}"

    def storage_location(self, repo_id: str, hub_file: HubFile) -> str:
        """A signed URL of the LFS file on the storage host, as the hub's 302 gives it."""
        expires = int(time.time()) + STORAGE_URL_LIFETIME_S
        path = f"/lfs/{repo_id}/{hub_file.sha256}"
        name = quote(hub_file.path.rsplit("/", 1)[-1], safe="")
        return (
            f"{self.storage_url}{path}?filename={name}&expires={expires}"
            f"&signature={self._signature(path, expires)}"
        )

    def _signature(self, path: str, expires: int) -> str:
        return hmac.new(self._signing_key, f"{path}\n{expires}".encode(), "sha256").hexdigest()

    def signature_valid(self, path: str, expires: str, signature: str) -> bool:
        if not expires.isdigit() or int(expires) < time.time():
            return False
        return hmac.compare_digest(self._signature(path, int(expires)), signature)

    # --- fault switches --------------------------------------------------------------------

    def fail_next(self, n: int, status: int = 503, retry_after_s: int | None = None) -> None:
        """The next n requests to either origin (lab control aside) are answered with `status`,
        with a Retry-After header when retry_after_s is given (a 429 always has one)."""
        with self._lock:
            self._faults.fail_remaining = n
            self._faults.fail_status = status
            self._faults.retry_after_s = retry_after_s

    def rate_limit(self, n: int, retry_after_s: int = DEFAULT_RETRY_AFTER_S) -> None:
        """The next n requests are answered 429 Too Many Requests, as the real hub's rate
        limit answers: Retry-After and the RateLimit headers."""
        self.fail_next(n, 429, retry_after_s)

    def cut_next_file(self, after_bytes: int) -> None:
        """The next file body is cut (connection closed) after `after_bytes` bytes."""
        with self._lock:
            self._faults.cut_after_bytes = after_bytes

    def slow(self, bytes_per_s: int | None) -> None:
        """File bodies are sent at most this fast per response (None: full speed)."""
        with self._lock:
            self._faults.slow_bytes_per_s = bytes_per_s or None

    def reset_faults(self) -> None:
        with self._lock:
            self._faults = Faults()

    def faults(self) -> Faults:
        with self._lock:
            return Faults(**asdict(self._faults))

    def apply_fault_request(self, request: Mapping[str, Any]) -> None:
        """Apply a POST /_lab/faults body; ValueError names what is wrong."""
        known = {"reset", "fail_next", "status", "retry_after", "cut_next_file", "slow"}
        unknown = sorted(set(request) - known)
        if unknown:
            raise ValueError(f"unknown fault keys {unknown}; known: {sorted(known)}")
        for key in ("fail_next", "status", "retry_after", "cut_next_file", "slow"):
            value = request.get(key)
            nullable = key in ("slow", "retry_after")
            if key in request and not (
                (nullable and value is None)
                or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
            ):
                raise ValueError(f"fault {key}: expected a non-negative integer, got {value!r}")
        for key in ("status", "retry_after"):
            if key in request and "fail_next" not in request:
                raise ValueError(f"fault {key}: only meaningful with fail_next")
        if request.get("reset"):
            self.reset_faults()
        if "fail_next" in request:
            self.fail_next(
                request["fail_next"], request.get("status", 503), request.get("retry_after")
            )
        if "cut_next_file" in request:
            self.cut_next_file(request["cut_next_file"])
        if "slow" in request:
            self.slow(request["slow"])

    def _take_failure(self) -> tuple[int, int | None] | None:
        """(status, Retry-After seconds) of the next injected failure, if one is due."""
        with self._lock:
            if self._faults.fail_remaining <= 0:
                return None
            self._faults.fail_remaining -= 1
            retry_after = self._faults.retry_after_s
            if retry_after is None and self._faults.fail_status == 429:
                retry_after = DEFAULT_RETRY_AFTER_S
            return self._faults.fail_status, retry_after

    def _take_cut(self) -> int | None:
        with self._lock:
            cut, self._faults.cut_after_bytes = self._faults.cut_after_bytes, None
            return cut

    # --- statistics ------------------------------------------------------------------------

    @property
    def bytes_served(self) -> int:
        """Body bytes of files sent since start (or the last reset_stats)."""
        with self._lock:
            return self._bytes_served

    @property
    def request_count(self) -> int:
        with self._lock:
            return self._request_count

    def requests(self) -> list[RequestRecord]:
        """The latest requests (lab control aside), oldest first."""
        with self._lock:
            return [replace(record) for record in self._log]

    def reset_stats(self) -> None:
        with self._lock:
            self._log.clear()
            self._request_count = 0
            self._bytes_served = 0

    def _begin(self, record: RequestRecord) -> None:
        with self._lock:
            self._log.append(record)
            self._request_count += 1

    def _set_status(self, record: RequestRecord, status: int) -> None:
        with self._lock:
            record.status = status

    def _count_bytes(self, record: RequestRecord, count: int) -> None:
        """Add count body bytes (negative to take back bytes counted but never sent)."""
        with self._lock:
            record.bytes_sent += count
            self._bytes_served += count

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": self._request_count,
                "bytes_served": self._bytes_served,
                "authorization": self._authorization_by_origin(),
                "log": [asdict(record) for record in self._log],
            }

    def authorization_by_origin(self) -> dict[str, list[str]]:
        """Per origin, the fingerprints (fingerprint()) of the Authorization headers it was
        sent, in the order first seen (from the request log: since start or reset_stats)."""
        with self._lock:
            return self._authorization_by_origin()

    def _authorization_by_origin(self) -> dict[str, list[str]]:
        seen: dict[str, list[str]] = {HUB: [], STORAGE: []}
        for record in self._log:
            if record.authorization and record.authorization not in seen[record.origin]:
                seen[record.origin].append(record.authorization)
        return seen

    def repo_sha(self, repo_id: str) -> str:
        """The commit sha the hub serves for a repo now."""
        state = self.index.state(repo_id)
        if state is None:
            raise FileNotFoundError(f"no repo {repo_id} under {self.repos_dir}")
        return state.sha


class HubControl:
    """A lab hub running in another process (`python -m lab.hub`, the lab's), driven over its
    /_lab/ endpoints: the fault switches and the request log of HubServer."""

    def __init__(self, url: str, *, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._timeout_s = timeout_s

    def _call(self, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.url}/_lab/{path}",
            data=data,
            method="GET" if body is None else "POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as reply:
                answer: dict[str, Any] = json.loads(reply.read())
        except urllib.error.HTTPError as error:
            raise RuntimeError(
                f"lab hub {self.url}/_lab/{path}: HTTP {error.code} {error.read()[:300]!r}"
            ) from error
        return answer

    def set_faults(self, **request: Any) -> Faults:
        """POST /_lab/faults (the keys of HubServer.apply_fault_request); the faults now."""
        return Faults(**self._call("faults", request))

    def stats(self) -> dict[str, Any]:
        return self._call("stats")

    def reset_stats(self) -> None:
        self._call("stats", {"reset": True})

    def requests(self) -> list[RequestRecord]:
        return [RequestRecord(**record) for record in self.stats()["log"]]

    def authorization_by_origin(self) -> dict[str, list[str]]:
        by_origin: dict[str, list[str]] = self.stats()["authorization"]
        return by_origin


class _HubHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    hub: HubServer
    origin: str

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()

    def track(self, connection: socket.socket, open_: bool) -> None:
        with self._connections_lock:
            if open_:
                self._connections.add(connection)
            else:
                self._connections.discard(connection)

    def close_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


def _injected_error(status: int, retry_after_s: int | None, bucket: str) -> _HubError:
    headers = {} if retry_after_s is None else {"Retry-After": str(retry_after_s)}
    if status == 429:
        headers["RateLimit"] = f'"{bucket}";r=0;t={retry_after_s}'
        headers["RateLimit-Policy"] = (
            f'"fixed window";"{bucket}";q={RATE_LIMIT_QUOTA};w={RATE_LIMIT_WINDOW_S}'
        )
        return _HubError(
            429,
            f"lab hub: rate limit reached (injected); retry after {retry_after_s} s",
            headers=headers,
        )
    return _HubError(status, f"lab hub: injected failure ({status})", headers=headers)


class _HubError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        error_code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code
        self.headers = dict(headers or {})


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "lab-hub/1"
    timeout = CONNECTION_IDLE_TIMEOUT_S
    server: _HubHTTPServer

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, True)

    def finish(self) -> None:
        self.server.track(self.connection, False)
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        """Requests go to the hub's own log (stats), not to stderr."""

    @property
    def hub(self) -> HubServer:
        return self.server.hub

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def do_POST(self) -> None:
        self._handle("POST")

    def _handle(self, method: str) -> None:
        self._record: RequestRecord | None = None
        url = urlsplit(self.path)
        segments = [unquote(segment) for segment in url.path.split("/")[1:]]
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        if segments[:1] == ["_lab"]:
            self._lab_control(method, segments[1:])
            return
        authorization = self.headers.get("Authorization")
        self._record = RequestRecord(
            method,
            self.path,
            self.headers.get("Range"),
            authorization is not None,
            self.server.origin,
            fingerprint(authorization) if authorization is not None else None,
        )
        self.hub._begin(self._record)
        try:
            failure = self.hub._take_failure()
            if failure is not None:
                bucket = "api" if segments[:1] == ["api"] else "resolvers"
                raise _injected_error(*failure, bucket)
            if self.server.origin == STORAGE:
                self._route_storage(method, segments, query)
            else:
                self._check_token()
                self._route(method, segments, query)
        except _HubError as error:
            self._send_error(method, error)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _route(self, method: str, segments: list[str], query: dict[str, str]) -> None:
        if segments[:2] == ["api", "models"] and len(segments) >= 4 and method == "GET":
            repo_id = "/".join(segments[2:4])
            rest = segments[4:]
            state = self._repo(repo_id)
            if not rest:
                self._send_json(_repo_info(state, query))
                return
            if rest[0] == "revision" and len(rest) == 2:
                self._check_revision(state, rest[1])
                self._send_json(_repo_info(state, query))
                return
            if rest[0] == "tree" and len(rest) >= 2:
                self._check_revision(state, rest[1])
                self._send_tree(state, rest[1], "/".join(rest[2:]), query)
                return
        if len(segments) >= 5 and segments[2] == "resolve" and method in ("GET", "HEAD"):
            state = self._repo("/".join(segments[:2]))
            self._check_revision(state, segments[3])
            self._check_access(state)
            self._resolve(method, state, "/".join(segments[4:]))
            return
        raise _HubError(404, f"lab hub: no route for {method} {self.path}")

    def _route_storage(self, method: str, segments: list[str], query: dict[str, str]) -> None:
        """The storage host: an LFS file by its sha256, for a URL the hub signed. The token is
        neither needed nor looked at, as on the real hub's storage."""
        if method not in ("GET", "HEAD") or len(segments) != 4 or segments[0] != "lfs":
            raise _HubError(404, f"lab storage: no route for {method} {self.path}")
        path = urlsplit(self.path).path
        if not self.hub.signature_valid(path, query.get("expires", ""), query.get("signature", "")):
            raise _HubError(403, "lab storage: the URL's signature is invalid or has expired")
        state = self.hub.index.state("/".join(segments[1:3]))
        stored = (
            [] if state is None else [f for f in state.files.values() if f.sha256 == segments[3]]
        )
        if state is None or not stored:
            raise _HubError(404, f"lab storage: no object {segments[3]}")
        self._send_bytes(
            method,
            state.root / stored[0].path,
            stored[0].size,
            {
                "ETag": f'"{stored[0].sha256}"',
                "Content-Disposition": f'attachment; filename="{query.get("filename", "")}"',
            },
        )

    def _check_token(self) -> None:
        """A token that is no Hugging Face token at all is refused on every hub endpoint."""
        authorization = self.headers.get("Authorization")
        if authorization is None:
            return
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.startswith("hf_"):
            raise _HubError(401, "Invalid credentials in Authorization header")

    def _repo(self, repo_id: str) -> RepoState:
        state = self.hub.index.state(repo_id)
        if state is None:
            # Anonymously, a missing repo is 401: the hub does not say whether a private one
            # exists.
            status = 404 if "Authorization" in self.headers else 401
            raise _HubError(status, "Repository not found", "RepoNotFound")
        return state

    def _check_revision(self, state: RepoState, revision: str) -> None:
        if revision not in ("main", state.sha):
            raise _HubError(
                404, f"Invalid rev id: {revision}", "RevisionNotFound", {"X-Repo-Commit": state.sha}
            )

    def _check_access(self, state: RepoState) -> None:
        if state.gated_tokens is None:
            return
        authorization = self.headers.get("Authorization", "")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token in state.gated_tokens:
            return
        if not authorization:
            raise _HubError(
                401,
                f"Access to model {state.repo_id} is restricted. You must have access to it and"
                " be authenticated to access it. Please log in.",
                "GatedRepo",
            )
        raise _HubError(
            403,
            f"Access to model {state.repo_id} is restricted and you are not in the authorized"
            f" list. Visit {self.hub.url}/{state.repo_id} to ask for access.",
            "GatedRepo",
        )

    def _send_tree(
        self, state: RepoState, revision: str, prefix: str, query: dict[str, str]
    ) -> None:
        recursive = query.get("recursive", "false").lower() == "true"
        directories = state.directories()
        if prefix and prefix not in directories:
            raise _HubError(404, f"{prefix} does not exist in {state.repo_id}", "EntryNotFound")
        base = f"{prefix}/" if prefix else ""

        def wanted(path: str) -> bool:
            return path.startswith(base) and (recursive or "/" not in path[len(base) :])

        entries = [
            {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
            for d in directories
            if wanted(d)
        ] + [f.tree_entry() for f in state.files.values() if wanted(f.path)]
        try:
            start = int(query.get("cursor", "0"))
        except ValueError as exc:
            raise _HubError(400, f"bad cursor {query.get('cursor')!r}") from exc
        page = entries[start : start + self.hub.page_size]
        headers = {}
        if start + self.hub.page_size < len(entries):
            path = f"/api/models/{state.repo_id}/tree/{quote(revision, safe='')}"
            if prefix:
                path += "/" + quote(prefix, safe="")
            next_query = f"recursive={str(recursive).lower()}&expand=false"
            next_query += f"&cursor={start + self.hub.page_size}"
            host = self.headers.get("Host") or "{}:{}".format(*self.connection.getsockname()[:2])
            headers["Link"] = f'<http://{host}{path}?{next_query}>; rel="next"'
        self._send_json(page, headers)

    def _resolve(self, method: str, state: RepoState, path: str) -> None:
        """A small file's bytes; for an LFS file, a redirect to the storage host that carries
        the file's metadata (the client reads it from this response and does not follow a
        HEAD's redirect to another origin)."""
        hub_file = state.files.get(path)
        if hub_file is None:
            raise _HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": state.sha})
        headers = {"ETag": f'"{hub_file.blob_id}"', "X-Repo-Commit": state.sha}
        if hub_file.sha256 is None:
            self._send_bytes(method, state.root / path, hub_file.size, headers)
            return
        location = self.hub.storage_location(state.repo_id, hub_file)
        body = f"Found. Redirecting to {location}".encode()
        self._send_head(
            302,
            {
                **headers,
                "Location": location,
                "X-Linked-Etag": f'"{hub_file.sha256}"',
                "X-Linked-Size": str(hub_file.size),
                "Content-Type": "text/plain; charset=utf-8",
                "Content-Length": str(len(body)),
            },
        )
        if method == "GET":
            self.wfile.write(body)

    def _send_bytes(self, method: str, path: Path, size: int, headers: Mapping[str, str]) -> None:
        """The file at `path` (`size` bytes), or the one range a Range header asks for."""
        first, last = 0, size - 1
        requested = self.headers.get("Range")
        status = 200
        if requested is not None and size > 0:
            parsed = _parse_range(requested, size)
            if parsed is None:
                raise _HubError(
                    416,
                    f"Range {requested} not satisfiable for {size} bytes",
                    headers={"Content-Range": f"bytes */{size}"},
                )
            first, last = parsed
            status = 206
        length = max(0, last - first + 1)
        sent = {
            "Content-Type": "application/octet-stream",
            "Content-Length": str(length),
            "Accept-Ranges": "bytes",
            **headers,
        }
        if status == 206:
            sent["Content-Range"] = f"bytes {first}-{last}/{size}"
        self._send_head(status, sent)
        if method == "HEAD" or length == 0:
            return
        self._send_body(path, first, length)

    def _send_body(self, path: Path, offset: int, length: int) -> None:
        cut = self.hub._take_cut()
        rate = self.hub.faults().slow_bytes_per_s
        to_send = length if cut is None else min(cut, length)
        with open(path, "rb") as handle:
            if rate is None:
                position = offset
                while position < offset + to_send:
                    count = min(SEND_CHUNK_BYTES, offset + to_send - position)
                    # Counted before sending, so the stats are complete once the client has
                    # the bytes; what a broken connection did not take is taken back.
                    self._count_bytes(count)
                    try:
                        sent = self.connection.sendfile(handle, position, count)
                    except OSError:
                        self._count_bytes(-count)
                        raise
                    self._count_bytes(sent - count)
                    if sent == 0:
                        break
                    position += sent
            else:
                self._send_paced(handle, offset, to_send, rate)
        if cut is not None and to_send < length:
            # Like a dropped connection mid-file: the client sees a body shorter than announced.
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

    def _send_paced(self, handle: Any, offset: int, to_send: int, rate: int) -> None:
        chunk = max(1, min(rate // 20, SEND_CHUNK_BYTES))
        started = time.monotonic()
        sent = 0
        while sent < to_send:
            data = os.pread(handle.fileno(), min(chunk, to_send - sent), offset + sent)
            if not data:
                break
            self._count_bytes(len(data))
            try:
                self.wfile.write(data)
            except OSError:
                self._count_bytes(-len(data))
                raise
            sent += len(data)
            ahead = sent / rate - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)

    # --- lab control -----------------------------------------------------------------------

    def _lab_control(self, method: str, segments: list[str]) -> None:
        try:
            if method not in ("GET", "POST"):
                raise _HubError(405, f"lab hub: {method} is not a lab control method")
            if segments == ["faults"]:
                if method == "POST":
                    self.hub.apply_fault_request(self._json_body())
                self._send_json(asdict(self.hub.faults()))
                return
            if segments == ["stats"]:
                if method == "POST" and self._json_body().get("reset"):
                    self.hub.reset_stats()
                self._send_json(self.hub.stats())
                return
            raise _HubError(404, f"lab hub: no control endpoint {self.path}")
        except ValueError as error:
            self._send_error(method, _HubError(400, f"lab hub: {error}"))
        except _HubError as error:
            self._send_error(method, error)

    def _json_body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b"{}"
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"the request body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        return body

    # --- responses -------------------------------------------------------------------------

    def _count_bytes(self, count: int) -> None:
        if self._record is not None:
            self.hub._count_bytes(self._record, count)

    def _send_head(self, status: int, headers: Mapping[str, str]) -> None:
        if self._record is not None:
            self.hub._set_status(self._record, status)
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()

    def _send_json(self, payload: object, headers: Mapping[str, str] | None = None) -> None:
        body = json.dumps(payload).encode()
        self._send_head(
            200,
            {
                "Content-Type": "application/json",
                "Content-Length": str(len(body)),
                **(headers or {}),
            },
        )
        self.wfile.write(body)

    def _send_error(self, method: str, error: _HubError) -> None:
        body = b"" if method == "HEAD" else json.dumps({"error": error.message}).encode()
        headers = {
            "Content-Type": "application/json",
            "Content-Length": str(len(body)),
            **error.headers,
        }
        if self.server.origin == HUB:  # the storage host is no Hugging Face server
            headers["X-Error-Message"] = error.message
        if error.error_code is not None:
            headers["X-Error-Code"] = error.error_code
        self._send_head(error.status, headers)
        if body:
            self.wfile.write(body)


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """(first, last) inclusive of a single `bytes=` range, or None when not satisfiable."""
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return None
    start_text, _, end_text = spec.strip().partition("-")
    try:
        if not start_text:
            suffix = int(end_text)
            return (max(0, size - suffix), size - 1) if suffix > 0 else None
        first = int(start_text)
        last = int(end_text) if end_text else size - 1
    except ValueError:
        return None
    if first >= size or last < first:
        return None
    return first, min(last, size - 1)


def _repo_info(state: RepoState, query: Mapping[str, str]) -> dict[str, Any]:
    with_blobs = query.get("blobs", "false").lower() == "true"
    modified = datetime.fromtimestamp(state.last_modified, UTC).isoformat().replace("+00:00", "Z")
    org = state.repo_id.split("/")[0]
    return {
        "_id": state.sha[:24],
        "id": state.repo_id,
        "modelId": state.repo_id,
        "author": org,
        "sha": state.sha,
        "lastModified": modified,
        "createdAt": modified,
        "private": False,
        "gated": "manual" if state.gated_tokens is not None else False,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "library_name": "transformers",
        "siblings": [
            f.sibling() if with_blobs else {"rfilename": f.path} for f in state.files.values()
        ],
        "usedStorage": sum(f.size for f in state.files.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.hub", description="Serve lab repos as a Hugging Face hub."
    )
    parser.add_argument("--repos", type=Path, required=True, help="repos_dir/<org>/<name>/")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--page-size", type=int, default=1000, help="tree entries per page")
    parser.add_argument(
        "--storage-host", help="the storage host's address (LFS downloads); default --host"
    )
    parser.add_argument("--storage-port", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.repos.is_dir():
        parser.error(f"--repos {args.repos}: not a directory")
    hub = HubServer(
        args.repos,
        args.host,
        args.port,
        page_size=args.page_size,
        storage_host=args.storage_host,
        storage_port=args.storage_port,
    ).start()
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    print(
        json.dumps({"url": hub.url, "storage_url": hub.storage_url, "pid": os.getpid()}),
        flush=True,
    )
    stopping.wait()
    hub.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
