"""This machine as a node: the sparkdeploy.remote.runner.Runner the tests give the steps.

LocalNode runs each command here, as sparkdeploy.remote.ssh runs it on a node, minus SSH; so
run_python gives the script to a fresh `python3 -I -S` (isolated, no site-packages): only the
standard library is importable, as on a DGX node where nothing of ours is installed.
stream_lines runs an argv (e.g. sparkdeploy.node_script.python_argv's, itself -I -S) with its
output merged and read line by line, as Connection.stream_lines does. ScriptedNode runs nothing:
it answers each command with the next scripted answer.

Commands run with the PATH sshd gives a command on a node, so `python3` is the system's, not a
developer's shim (pyenv's costs a tenth of a second per launch, which a benchmark would charge
to the node script).
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from sparkdeploy.remote.runner import CommandResult, Runner, StreamEnd

WATCH_POLL_S = 0.1
# The node scripts' compiled-code cache (sparkdeploy.remote.node_script) goes in a directory of the
# test session's own, not in this machine's ~/.cache.
_NODE_CACHE = tempfile.TemporaryDirectory(prefix="sparkdeploy-node-cache-")
NODE_PATH = "/usr/local/bin:/usr/bin:/bin"
NODE_ENV = {"PATH": NODE_PATH, "XDG_CACHE_HOME": _NODE_CACHE.name}


class LocalStream:
    """The merged output lines of a local process; it is killed at the timeout or when idle."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        idle_timeout: float | None,
        env: Mapping[str, str],
    ) -> None:
        self.argv = tuple(argv)
        self.exit_code: int | None = None
        self.ended: StreamEnd | None = None
        self._process = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self._deadline = time.monotonic() + timeout
        self._idle_timeout = idle_timeout
        self._last_output = time.monotonic()
        self._done = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        while not self._done.wait(WATCH_POLL_S):
            now = time.monotonic()
            idle = self._idle_timeout is not None and now - self._last_output > self._idle_timeout
            if now > self._deadline or idle:
                self.ended = "idle" if idle else "timeout"
                self._process.kill()
                return

    def __iter__(self) -> Iterator[bytes]:
        assert self._process.stdout is not None
        try:
            for line in self._process.stdout:
                self._last_output = time.monotonic()
                yield line.rstrip(b"\r\n")
            returncode = self._process.wait(timeout=10)
            if self.ended is None:
                self.ended = "exited"
                self.exit_code = returncode
        finally:
            self.close()

    def close(self) -> None:
        self._done.set()
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait(timeout=10)
        assert self._process.stdout is not None
        self._process.stdout.close()


@dataclass(frozen=True)
class Ran:
    """One command a LocalNode was given."""

    argv: tuple[str, ...]
    stdin: bytes


class LocalNode(Runner):
    """Runs each command here with the node's environment (`path`: its PATH) and keeps them,
    in order: `ran` (run's and run_python's), `streamed` (stream_lines' argv)."""

    def __init__(self, path: str = NODE_PATH) -> None:
        self.env = {**NODE_ENV, "PATH": path}
        self.ran: list[Ran] = []
        self.streamed: list[tuple[str, ...]] = []

    def run(
        self, argv: Sequence[str], *, timeout: float, stdin: bytes | None = None, check: bool = True
    ) -> CommandResult:
        ran = Ran(tuple(argv), stdin or b"")
        self.ran.append(ran)
        result = self.answer(ran, timeout)
        assert not check or result.exit_code == 0, result.stderr.decode()
        return result

    def answer(self, ran: Ran, timeout: float) -> CommandResult:
        completed = subprocess.run(
            ran.argv, input=ran.stdin, capture_output=True, timeout=timeout, env=self.env
        )
        return CommandResult(ran.argv, completed.returncode, completed.stdout, completed.stderr)

    def stream_lines(
        self, argv: Sequence[str], *, timeout: float, idle_timeout: float | None = None
    ) -> LocalStream:
        self.streamed.append(tuple(argv))
        return LocalStream(argv, timeout=timeout, idle_timeout=idle_timeout, env=self.env)


class ScriptedNode(LocalNode):
    """Runs nothing: answers each command with the next scripted (exit code, stdout, stderr)."""

    def __init__(self, *answers: tuple[int, bytes, bytes]) -> None:
        super().__init__()
        self.answers = list(answers)

    def answer(self, ran: Ran, timeout: float) -> CommandResult:
        code, stdout, stderr = self.answers.pop(0)
        return CommandResult(ran.argv, code, stdout, stderr)
