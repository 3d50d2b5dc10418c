"""One hub file into a partial file that outlives the process, hashed while it is written.

Plain http.client (stdlib only): one keep-alive connection per origin per thread, a socket
timeout on every connect and read, redirects followed (the hub answers an LFS file's `resolve`
with a 302 to its storage host, another origin), and the hub token sent to the hub's own origin
only, never to a redirect target elsewhere, as huggingface_hub does (docs/field.md, "The Hugging
Face hub"). A cut transfer is resumed with a Range request from the partial file's exact size,
within the call (transient failures, with backoff, or after the wait a Retry-After header asks
for) and across calls and processes (the partial stays on disk).

Bytes written are dropped from the page cache as the transfer goes: on unified-memory nodes
cached pages are memory the model needs.
"""

from __future__ import annotations

import email.utils
import hashlib
import http.client
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urljoin, urlsplit

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5
READ_CHUNK_BYTES = 1 << 20
HASH_CHUNK_BYTES = 8 << 20
# Written pages are handed to writeback one window at a time and dropped a window later, once
# that writeback has had time to finish (DONTNEED cannot drop pages that are still dirty).
CACHE_DROP_WINDOW_BYTES = 32 << 20
USER_AGENT = "sparkdeploy-prefetch/1"

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")

Origin = tuple[str, str, int]


class HttpStatusError(Exception):
    """The server answered a status that no retry will change (401, 403, 404, ...).

    `error_code` is the hub's X-Error-Code (GatedRepo, RepoNotFound, RevisionNotFound,
    EntryNotFound), None when it sent none (the storage host never does).
    """

    def __init__(self, status: int, url: str, detail: str, error_code: str | None = None) -> None:
        super().__init__(f"HTTP {status} for {url}: {detail}" if detail else f"HTTP {status}")
        self.status = status
        self.url = url
        self.detail = detail
        self.error_code = error_code


class ProtocolError(Exception):
    """The server's answer contradicts the file list (size, range) or redirects without end."""


class TransferError(Exception):
    """A transient failure (reset, timeout, short body, 5xx) that outlasted every attempt."""


class _Transient(Exception):
    """One attempt failed in a way worth retrying; retry_after_s: the wait the server asked for."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def retry_after_s(headers: Mapping[str, str] | http.client.HTTPMessage) -> float | None:
    """The seconds a Retry-After header asks to wait (delay-seconds or an HTTP date, RFC 9110
    section 10.2.3), None without a usable one."""
    value = (headers.get("Retry-After") or "").strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def origin_of(url: str) -> Origin:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or (443 if scheme == "https" else 80)
    return scheme, (parts.hostname or "").lower(), port


class Connections:
    """One thread's keep-alive connections, one per origin. Not shared between threads."""

    def __init__(self, *, timeout_s: float, token: str | None, token_origin: Origin) -> None:
        self._timeout_s = timeout_s
        self._token = token
        self._token_origin = token_origin
        self._open: dict[Origin, http.client.HTTPConnection] = {}

    def __enter__(self) -> Connections:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        for connection in self._open.values():
            connection.close()
        self._open.clear()

    def get(self, url: str, headers: dict[str, str]) -> tuple[http.client.HTTPResponse, str]:
        """The response to GET `url` once redirects are followed (body unread), and its URL."""
        for _ in range(MAX_REDIRECTS + 1):
            response = self._get_once(url, headers)
            if response.status not in REDIRECT_STATUS:
                return response, url
            location = response.getheader("Location")
            response.read()  # a redirect's body is a line or two; reading it keeps the connection
            if not location:
                raise ProtocolError(f"HTTP {response.status} without a Location header for {url}")
            url = urljoin(url, location)
        raise ProtocolError(f"more than {MAX_REDIRECTS} redirects, the last to {url}")

    def _get_once(self, url: str, headers: dict[str, str]) -> http.client.HTTPResponse:
        origin = origin_of(url)
        parts = urlsplit(url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        sent = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity", **headers}
        if self._token and origin == self._token_origin:
            sent["Authorization"] = f"Bearer {self._token}"
        connection = self._connection(origin)
        try:
            connection.request("GET", target, headers=sent)
            return connection.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            self.discard(origin)
            raise _Transient(f"GET {url}: {type(exc).__name__}: {exc}") from exc

    def _connection(self, origin: Origin) -> http.client.HTTPConnection:
        connection = self._open.get(origin)
        if connection is None:
            scheme, host, port = origin
            if scheme == "https":
                connection = http.client.HTTPSConnection(host, port, timeout=self._timeout_s)
            elif scheme == "http":
                connection = http.client.HTTPConnection(host, port, timeout=self._timeout_s)
            else:
                raise ProtocolError(f"cannot download over {scheme!r} from {host}")
            self._open[origin] = connection
        return connection

    def discard(self, origin: Origin) -> None:
        connection = self._open.pop(origin, None)
        if connection is not None:
            connection.close()


def hash_file(digest: Any, path: Path, length: int | None = None) -> None:
    """Feed the first `length` bytes (all if None) of `path` to `digest`, leaving none cached."""
    buffer = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    left = length
    with open(path, "rb", buffering=0) as fh:
        fd = fh.fileno()
        offset = 0
        while left is None or left > 0:
            want = HASH_CHUNK_BYTES if left is None else min(HASH_CHUNK_BYTES, left)
            n = fh.readinto(view[:want])
            if not n:
                break
            digest.update(view[:n])
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
            offset += n
            if left is not None:
                left -= n


def fetch(
    connections: Connections,
    url: str,
    partial: Path,
    *,
    size: int,
    new_digest: Callable[[], Any],
    attempts: int,
    backoff_s: float,
    max_retry_after_s: float,
    on_bytes: Callable[[int], None],
    on_retry: Callable[[str, int, float], None],
) -> str:
    """Complete `partial` to `size` bytes from `url`; the hex digest of what it then holds.

    `new_digest` makes a fresh hashlib object, primed with any prefix (the git blob header).
    A partial left by an earlier call is hashed once and resumed from its size. A transient
    failure is retried after backoff_s, doubling, or after the wait its Retry-After asks for
    when it says (a 429 or 503 from the hub): up to max_retry_after_s; a longer one ends the
    call with TransferError. `on_bytes` gets every count of bytes written (and, at the start,
    the resumed prefix); `on_retry` gets (reason, offset, delay_s) before each retry.
    """
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        state = _Partial(fd, os.fstat(fd).st_size, new_digest)
        if state.offset > size:
            state.restart()
        if state.offset:
            hash_file(state.digest, partial, state.offset)
            on_bytes(state.offset)
        for attempt in range(1, attempts + 1):
            try:
                _transfer(connections, url, state, size, on_bytes)
                break
            except _Transient as exc:
                if attempt == attempts:
                    raise TransferError(f"{exc} (attempt {attempt} of {attempts})") from exc
                delay = backoff_s * 2 ** (attempt - 1)
                if exc.retry_after_s is not None:
                    if exc.retry_after_s > max_retry_after_s:
                        raise TransferError(
                            f"{exc}: that is longer than the {max_retry_after_s:.0f} s a"
                            " download waits in place"
                        ) from exc
                    delay = exc.retry_after_s
                on_retry(str(exc), state.offset, delay)
                time.sleep(delay)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return str(state.digest.hexdigest())


class _Partial:
    """The partial file and the digest of its bytes, always in step."""

    def __init__(self, fd: int, offset: int, new_digest: Callable[[], Any]) -> None:
        self.fd = fd
        self.offset = offset
        self._new_digest = new_digest
        self.digest = new_digest()
        self._dropped_to = 0

    def restart(self) -> None:
        os.ftruncate(self.fd, 0)
        self.offset = 0
        self.digest = self._new_digest()
        self._dropped_to = 0

    def append(self, data: memoryview) -> None:
        written = 0
        while written < len(data):
            written += os.pwrite(self.fd, data[written:], self.offset + written)
        self.digest.update(data)
        self.offset += len(data)
        if self.offset - self._dropped_to >= 2 * CACHE_DROP_WINDOW_BYTES:
            self._drop_cached_window()

    def _drop_cached_window(self) -> None:
        # Start writeback of the newest window; drop the one before it, whose writeback the
        # previous call started.
        newest = self._dropped_to + CACHE_DROP_WINDOW_BYTES
        os.posix_fadvise(self.fd, newest, CACHE_DROP_WINDOW_BYTES, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(self.fd, self._dropped_to, CACHE_DROP_WINDOW_BYTES, os.POSIX_FADV_DONTNEED)
        self._dropped_to = newest


def _transfer(
    connections: Connections,
    url: str,
    state: _Partial,
    size: int,
    on_bytes: Callable[[int], None],
) -> None:
    """One request for the bytes from state.offset to the end, appended as they arrive."""
    if state.offset == size:
        return
    response, served_from = connections.get(
        url, {"Range": f"bytes={state.offset}-"} if state.offset else {}
    )
    try:
        if response.status == 200 and state.offset:
            state.restart()  # the server ignored the Range: the body is the whole file
        elif response.status == 206:
            _check_content_range(response, served_from, state.offset, size)
        elif response.status == 416:
            state.restart()
            raise _Transient(f"HTTP 416 for {served_from}: starting the file over")
        elif response.status in TRANSIENT_STATUS:
            wait = retry_after_s(response.msg)
            said = "" if wait is None else f" (Retry-After: {wait:.0f} s)"
            raise _Transient(f"HTTP {response.status} for {served_from}{said}", wait)
        elif response.status != 200:
            raise HttpStatusError(
                response.status,
                served_from,
                _error_detail(response),
                response.getheader("X-Error-Code"),
            )
        if response.length is not None and response.length != size - state.offset:
            raise ProtocolError(
                f"{served_from} announces {response.length} bytes from byte {state.offset}, "
                f"the file list says {size - state.offset}"
            )
        _copy_body(response, served_from, state, size, on_bytes)
    finally:
        if not response.isclosed():
            connections.discard(origin_of(served_from))


def _copy_body(
    response: http.client.HTTPResponse,
    url: str,
    state: _Partial,
    size: int,
    on_bytes: Callable[[int], None],
) -> None:
    buffer = bytearray(READ_CHUNK_BYTES)
    view = memoryview(buffer)
    while state.offset < size:
        want = min(READ_CHUNK_BYTES, size - state.offset)
        try:
            n = response.readinto(view[:want])
        except (OSError, http.client.HTTPException) as exc:
            raise _Transient(
                f"{url}: {type(exc).__name__} after byte {state.offset} of {size}: {exc}"
            ) from exc
        if not n:
            # http.client reports a body cut short of its Content-Length as a plain end of data.
            raise _Transient(f"{url}: connection closed after byte {state.offset} of {size}")
        state.append(view[:n])
        on_bytes(n)


def _check_content_range(
    response: http.client.HTTPResponse, url: str, offset: int, size: int
) -> None:
    header = response.getheader("Content-Range") or ""
    match = _CONTENT_RANGE.match(header.strip())
    if match is None or int(match.group(1)) != offset or int(match.group(2)) != size - 1:
        raise ProtocolError(
            f"{url} answered a request for bytes {offset}- with Content-Range {header!r}, "
            f"expected bytes {offset}-{size - 1}/{size}"
        )


def _error_detail(response: http.client.HTTPResponse) -> str:
    """The hub's reason (X-Error-Message, else the start of the body) for an error status."""
    message = response.getheader("X-Error-Message")
    try:
        body = response.read(4096)
    except (OSError, http.client.HTTPException):
        body = b""
    return message or body.decode(errors="replace").strip()[:300]


def new_digest(algorithm: str, prefix: bytes = b"") -> Callable[[], Any]:
    """A factory of hashlib objects of `algorithm` already fed `prefix`."""

    def make() -> Any:
        digest = hashlib.new(algorithm)
        digest.update(prefix)
        return digest

    return make
