"""One request to the lab hub: routed by origin, answered as the hub (repo info, trees, files
and redirects, with its access checks) or its storage host answers, or as lab control; the fault
switches applied and the request logged."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from lab.hub.errors import HubError, injected_error
from lab.hub.index import RepoState, repo_info
from lab.hub.request_log import HUB, STORAGE, RequestRecord, fingerprint

if TYPE_CHECKING:
    from lab.hub.server import HubHTTPServer, HubServer

SEND_CHUNK_BYTES = 16 * 1024 * 1024
# Idle keep-alive connections are closed after this, so no handler thread waits forever.
CONNECTION_IDLE_TIMEOUT_S = 60.0


class HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "lab-hub/1"
    timeout = CONNECTION_IDLE_TIMEOUT_S
    server: HubHTTPServer

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
        self.hub.request_log.begin(self._record)
        try:
            failure = self.hub.fault_switches.take_failure()
            if failure is not None:
                bucket = "api" if segments[:1] == ["api"] else "resolvers"
                raise injected_error(*failure, bucket)
            if self.server.origin == STORAGE:
                self._route_storage(method, segments, query)
            else:
                self._check_token()
                self._route(method, segments, query)
        except HubError as error:
            self._send_error(method, error)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _route(self, method: str, segments: list[str], query: dict[str, str]) -> None:
        if segments[:2] == ["api", "models"] and len(segments) >= 4 and method == "GET":
            repo_id = "/".join(segments[2:4])
            rest = segments[4:]
            state = self._repo(repo_id)
            if not rest:
                self._send_json(repo_info(state, query))
                return
            if rest[0] == "revision" and len(rest) == 2:
                self._check_revision(state, rest[1])
                self._send_json(repo_info(state, query))
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
        raise HubError(404, f"lab hub: no route for {method} {self.path}")

    def _route_storage(self, method: str, segments: list[str], query: dict[str, str]) -> None:
        """The storage host: an LFS file by its sha256, for a URL the hub signed. The token is
        neither needed nor looked at, as on the real hub's storage."""
        if method not in ("GET", "HEAD") or len(segments) != 4 or segments[0] != "lfs":
            raise HubError(404, f"lab storage: no route for {method} {self.path}")
        path = urlsplit(self.path).path
        if not self.hub.signature_valid(path, query.get("expires", ""), query.get("signature", "")):
            raise HubError(403, "lab storage: the URL's signature is invalid or has expired")
        state = self.hub.index.state("/".join(segments[1:3]))
        stored = (
            [] if state is None else [f for f in state.files.values() if f.sha256 == segments[3]]
        )
        if state is None or not stored:
            raise HubError(404, f"lab storage: no object {segments[3]}")
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
            raise HubError(401, "Invalid credentials in Authorization header")

    def _repo(self, repo_id: str) -> RepoState:
        state = self.hub.index.state(repo_id)
        if state is None:
            # Anonymously, a missing repo is 401: the hub does not say whether a private one
            # exists.
            status = 404 if "Authorization" in self.headers else 401
            raise HubError(status, "Repository not found", "RepoNotFound")
        return state

    def _check_revision(self, state: RepoState, revision: str) -> None:
        if revision not in ("main", state.sha):
            raise HubError(
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
            raise HubError(
                401,
                f"Access to model {state.repo_id} is restricted. You must have access to it and"
                " be authenticated to access it. Please log in.",
                "GatedRepo",
            )
        raise HubError(
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
            raise HubError(404, f"{prefix} does not exist in {state.repo_id}", "EntryNotFound")
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
            raise HubError(400, f"bad cursor {query.get('cursor')!r}") from exc
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
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": state.sha})
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
                raise HubError(
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
        cut = self.hub.fault_switches.take_cut()
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
                raise HubError(405, f"lab hub: {method} is not a lab control method")
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
            raise HubError(404, f"lab hub: no control endpoint {self.path}")
        except ValueError as error:
            self._send_error(method, HubError(400, f"lab hub: {error}"))
        except HubError as error:
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
            self.hub.request_log.count_bytes(self._record, count)

    def _send_head(self, status: int, headers: Mapping[str, str]) -> None:
        if self._record is not None:
            self.hub.request_log.set_status(self._record, status)
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

    def _send_error(self, method: str, error: HubError) -> None:
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
