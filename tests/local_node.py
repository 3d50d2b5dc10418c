"""Run node scripts on this machine as sparkdeploy.remote.ssh runs them on a node, minus SSH.

run_python gives the script to a fresh `python3 -I -S` (isolated, no site-packages): only the
standard library is importable, as on a DGX node where nothing of ours is installed.
stream_lines runs an argv (e.g. sparkdeploy.node_script.python_argv's, itself -I -S) with its
output merged and read line by line, as Connection.stream_lines does.

Both run with the PATH sshd gives a command on a node, so `python3` is the system's, not a
developer's shim (pyenv's costs a tenth of a second per launch, which a benchmark would charge
to the node script).
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence

from sparkdeploy.remote.ssh import _PYTHON_BOOTSTRAP, CommandResult

WATCH_POLL_S = 0.1
# The node scripts' compiled-code cache (sparkdeploy.remote.node_script) goes in a directory of the
# test session's own, not in this machine's ~/.cache.
_NODE_CACHE = tempfile.TemporaryDirectory(prefix="sparkdeploy-node-cache-")
NODE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "XDG_CACHE_HOME": _NODE_CACHE.name}


class LocalStream:
    """The merged output lines of a local process; it is killed at the timeout or when idle."""

    def __init__(self, argv: Sequence[str], *, timeout: float, idle_timeout: float | None) -> None:
        self.exit_code: int | None = None
        self.ended: str | None = None
        self._process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=NODE_ENV,
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


class LocalPython:
    def run_python(
        self,
        source: str,
        args: Sequence[str],
        *,
        timeout: float,
        stdin: bytes | None = None,
        check: bool = True,
    ) -> CommandResult:
        # As Connection.run_python: the source's length in argv, the program's stdin after it.
        encoded = source.encode()
        argv = ("python3", "-I", "-S", "-c", _PYTHON_BOOTSTRAP, str(len(encoded)), *args)
        completed = subprocess.run(
            argv,
            input=encoded + (stdin or b""),
            capture_output=True,
            timeout=timeout,
            env=NODE_ENV,
        )
        assert not check or completed.returncode == 0, completed.stderr.decode()
        return CommandResult(argv, completed.returncode, completed.stdout, completed.stderr)

    def stream_lines(
        self, argv: Sequence[str], *, timeout: float, idle_timeout: float | None = None
    ) -> LocalStream:
        return LocalStream(argv, timeout=timeout, idle_timeout=idle_timeout)
