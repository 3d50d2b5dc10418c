"""SSH to the nodes: paramiko connections, commands as argv lists, fan-out over nodes.

A command is always an argv list; it reaches the node's shell only as `shlex.join(argv)`, so no
value (from a recipe or anywhere else) is ever interpreted by that shell. Host keys must be in
the inventory's known_hosts file (RejectPolicy), authentication is by key only (see
sparkdeploy.remote.ssh_client), and every command has a timeout. Connect failures that may pass
(refused, reset, timed out) are retried here, with backoff, and nowhere else; they surface as
TransientRemoteError when they persist.
"""

from __future__ import annotations

import atexit
import select
import shlex
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import paramiko

from sparkdeploy.errors import RemoteError, TransientRemoteError
from sparkdeploy.remote.runner import STDERR_TAIL_CHARS, CommandResult, Runner, StreamEnd
from sparkdeploy.remote.ssh_client import open_client

T = TypeVar("T")

BACKOFF_S = 0.5
_READ_CHUNK = 65536
# How often a streaming read wakes up to look at its stop event, deadline and idle time.
STREAM_POLL_S = 0.1
# After the output ends, how long to wait for the command's exit status to arrive.
EXIT_STATUS_WAIT_S = 5.0


@dataclass(frozen=True)
class SshTarget:
    host: str
    port: int
    user: str
    identity_file: str
    known_hosts: str
    connect_timeout_s: float = 10

    def __str__(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"


class Connection(Runner):
    """One SSH connection to one node. Thread-safe: each command opens its own channel."""

    def __init__(self, target: SshTarget, client: paramiko.SSHClient) -> None:
        self.target = target
        self._client = client

    @property
    def is_active(self) -> bool:
        transport = self._client.get_transport()
        return transport is not None and transport.is_active()

    def run(
        self, argv: Sequence[str], *, timeout: float, stdin: bytes | None = None, check: bool = True
    ) -> CommandResult:
        """Run argv on the node; RemoteError on a non-zero exit (with check) or the timeout."""
        argv, command, channel = self._open_channel(
            "run", argv, "cannot open an SSH channel for `{command}`"
        )
        try:
            return self._exchange(channel, argv, command, timeout, stdin, check)
        finally:
            channel.close()

    def _open_channel(
        self, caller: str, argv: Sequence[str], failure: str
    ) -> tuple[tuple[str, ...], str, paramiko.Channel]:
        """(argv as a tuple, its shell command, a new session channel) for `caller`'s argv.

        ValueError for an empty argv; TransientRemoteError when the connection is closed or the
        channel does not open, `failure` (with `{command}`) saying what could not be done.
        """
        argv = tuple(argv)
        if not argv:
            raise ValueError(f"{caller}() needs a non-empty argv")
        command = shlex.join(argv)
        transport = self._client.get_transport()
        if transport is None or not transport.is_active():
            raise TransientRemoteError(
                f"{self.target}: the SSH connection is closed; reconnect with"
                " sparkdeploy.remote.ssh.connect()"
            )
        try:
            channel = transport.open_session(timeout=self.target.connect_timeout_s)
        except (paramiko.SSHException, OSError) as error:
            raise self._channel_failure(failure, command, error) from error
        return argv, command, channel

    def _channel_failure(
        self, failure: str, command: str, error: Exception
    ) -> TransientRemoteError:
        return TransientRemoteError(f"{self.target}: {failure.format(command=command)}: {error}")

    def _exchange(
        self,
        channel: paramiko.Channel,
        argv: tuple[str, ...],
        command: str,
        timeout: float,
        stdin: bytes | None,
        check: bool,
    ) -> CommandResult:
        deadline = time.monotonic() + timeout
        channel.settimeout(timeout)
        channel.exec_command(command)
        # stdin is fed as the window allows while the output is read: sending it all first
        # deadlocks once the command's output fills the window before its input is consumed.
        stdin = stdin or b""
        stdin_sent = 0
        if not stdin:
            channel.shutdown_write()
        stdout, stderr = bytearray(), bytearray()
        while True:
            # The output is complete at EOF, not at the exit status: sshd may send the status
            # while output is still queued behind the window. EOF is read before draining, so
            # every byte that came before it is in the buffers being drained.
            at_eof = channel.eof_received
            progressed = False
            while channel.recv_ready():
                stdout += channel.recv(_READ_CHUNK)
                progressed = True
            while channel.recv_stderr_ready():
                stderr += channel.recv_stderr(_READ_CHUNK)
                progressed = True
            if at_eof:
                break
            if not channel.eof_received and (channel.closed or not _transport_alive(channel)):
                # The connection died under the command (sshd gone, the link down): closed
                # without the EOF that precedes every normal close. That is transient, and
                # waiting for the deadline would only delay the retry. The client is closed so
                # that cached_connection() reconnects for the retry.
                self._client.close()
                raise TransientRemoteError(
                    f"{self.target}: the SSH connection was lost while `{command}` ran"
                    f" (stderr so far: {_tail(stderr)}); the task retries on a new connection"
                )
            stdin_pending = stdin_sent < len(stdin)
            if stdin_pending and channel.send_ready():
                stdin_sent += channel.send(stdin[stdin_sent : stdin_sent + _READ_CHUNK])
                if stdin_sent == len(stdin):
                    channel.shutdown_write()
                progressed = True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RemoteError(
                    f"{self.target}: `{command}` did not finish within {timeout} s"
                    f" (stderr so far: {_tail(stderr)})"
                )
            if not progressed:
                # The channel's fileno turns readable on output or EOF; while stdin is pending,
                # wake up soon to see whether the window has room for more of it.
                select.select([channel], [], [], min(remaining, 0.02 if stdin_pending else 1.0))
        if not channel.status_event.wait(EXIT_STATUS_WAIT_S):
            raise RemoteError(
                f"{self.target}: `{command}` closed its output but sent no exit status within"
                f" {EXIT_STATUS_WAIT_S} s (stderr: {_tail(stderr)})"
            )
        result = CommandResult(argv, channel.recv_exit_status(), bytes(stdout), bytes(stderr))
        if check and result.exit_code != 0:
            raise RemoteError(
                f"{self.target}: `{command}` exited {result.exit_code}; stderr: {_tail(stderr)}"
            )
        return result

    def stream_lines(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        stop: threading.Event | None = None,
        idle_timeout: float | None = None,
    ) -> LineStream:
        """Start argv on the node and return its output (stdout and stderr merged) as lines.

        For commands that run until told otherwise (`docker logs -f`): the stream ends when the
        command exits, when `stop` is set, after `timeout` seconds in all, or after
        `idle_timeout` seconds without output, or when the connection is lost;
        `LineStream.ended` says which, and
        `LineStream.exit_code` holds the exit status once the command has exited.
        """
        failure = "cannot start `{command}` over SSH"
        argv, command, channel = self._open_channel("stream_lines", argv, failure)
        try:
            channel.set_combine_stderr(True)
            channel.settimeout(self.target.connect_timeout_s)
            channel.exec_command(command)
            channel.shutdown_write()
        except (paramiko.SSHException, OSError) as error:
            raise self._channel_failure(failure, command, error) from error
        return LineStream(
            channel,
            argv,
            deadline=time.monotonic() + timeout,
            stop=stop,
            idle_timeout=idle_timeout,
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class LineStream:
    """The output lines of one running command (see Connection.stream_lines); iterate it once.

    Lines come without their line ending. The channel is closed when the iteration ends, or by
    close() (which also makes a running iteration end).
    """

    def __init__(
        self,
        channel: paramiko.Channel,
        argv: tuple[str, ...],
        *,
        deadline: float,
        stop: threading.Event | None,
        idle_timeout: float | None,
    ) -> None:
        self.argv = argv
        self.exit_code: int | None = None
        self.ended: StreamEnd | None = None
        self._channel = channel
        self._deadline = deadline
        self._stop = stop if stop is not None else threading.Event()
        self._idle_timeout = idle_timeout

    def __iter__(self) -> Iterator[bytes]:
        channel = self._channel
        pending = bytearray()
        last_output = time.monotonic()
        channel.settimeout(STREAM_POLL_S)
        try:
            while True:
                ended = self._should_end(last_output)
                if ended is not None:
                    self.ended = ended
                    return
                try:
                    chunk = channel.recv(_READ_CHUNK)
                except TimeoutError:
                    continue
                if not chunk:
                    if self._stop.is_set():  # close() from another thread
                        self.ended = "stopped"
                        return
                    if not channel.eof_received:
                        # The connection died (no EOF precedes the close): the command's fate
                        # is unknown, so no exit status is made up (paramiko would say -1).
                        self.ended = "lost"
                        return
                    break
                last_output = time.monotonic()
                pending += chunk
                *lines, rest = pending.split(b"\n")
                pending = bytearray(rest)
                for line in lines:
                    yield bytes(line.rstrip(b"\r"))
            if pending:
                yield bytes(pending.rstrip(b"\r"))
            if channel.status_event.wait(EXIT_STATUS_WAIT_S):
                self.exit_code = channel.recv_exit_status()
            self.ended = "exited"
        finally:
            channel.close()

    def _should_end(self, last_output: float) -> StreamEnd | None:
        now = time.monotonic()
        if self._stop.is_set():
            return "stopped"
        if now >= self._deadline:
            return "timeout"
        if self._idle_timeout is not None and now - last_output >= self._idle_timeout:
            return "idle"
        return None

    def close(self) -> None:
        self._stop.set()
        self._channel.close()


def _transport_alive(channel: paramiko.Channel) -> bool:
    transport = channel.get_transport()
    return transport is not None and transport.is_active()


def _tail(data: bytes | bytearray) -> str:
    text = bytes(data).decode(errors="replace").strip()
    return repr(text[-STDERR_TAIL_CHARS:]) if text else "(empty)"


def connect(target: SshTarget, *, attempts: int = 3) -> Connection:
    """A new connection; transient connect failures are retried with exponential backoff."""
    for attempt in range(1, attempts + 1):
        try:
            return Connection(target, open_client(target))
        except TransientRemoteError:
            if attempt == attempts:
                raise
            time.sleep(BACKOFF_S * 2 ** (attempt - 1))
    raise ValueError(f"connect() needs attempts >= 1, got {attempts}")


_cache: dict[SshTarget, Connection] = {}
_cache_lock = threading.Lock()


def cached_connection(target: SshTarget) -> Connection:
    """This process's open connection to target, (re)connecting when there is none or it died.

    Callers must not close it; close_cached() does, e.g. at the end of a task.
    """
    with _cache_lock:
        connection = _cache.get(target)
        if connection is not None and connection.is_active:
            return connection
    fresh = connect(target)
    with _cache_lock:
        previous = _cache.get(target)
        if previous is not None and previous.is_active:
            fresh.close()
            return previous
        _cache[target] = fresh
        return fresh


def close_cached() -> None:
    """Close every cached connection (also done at interpreter exit)."""
    with _cache_lock:
        connections = list(_cache.values())
        _cache.clear()
    for connection in connections:
        connection.close()


atexit.register(close_cached)


def on_all(
    targets: Mapping[str, SshTarget],
    fn: Callable[[Connection], T],
    *,
    max_parallel: int = 16,
) -> dict[str, T]:
    """fn on every node at once (cached connections); results by node name, in targets' order.

    The first failure is raised after every node has finished, its message naming the node.
    """
    if not targets:
        return {}

    def on_node(target: SshTarget) -> T:
        return fn(cached_connection(target))

    with ThreadPoolExecutor(max_workers=min(max_parallel, len(targets))) as pool:
        futures = {name: pool.submit(on_node, target) for name, target in targets.items()}
    results: dict[str, T] = {}
    for name, future in futures.items():
        error = future.exception()
        if error is not None:
            if isinstance(error, RemoteError) and not str(error).startswith(f"node {name}:"):
                raise type(error)(f"node {name}: {error}") from error
            raise error
        results[name] = future.result()
    return results
