"""What the steps need of a node, as one protocol: run a command, run a Python script, stream a
command's output lines.

sparkdeploy.remote.ssh.Connection runs them on a node over SSH; the tests' local node
(lab/testing/local_node.py) runs them on this machine. Every user of a node takes a Runner.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

# How much of a failed command's stderr an error message quotes.
STDERR_TAIL_CHARS = 2000
# Reads the program's source off stdin (length in argv[1]), then runs it as __main__ with
# argv[1:] = the caller's args and the rest of stdin left for the program.
_PYTHON_BOOTSTRAP = (
    "import sys; size = int(sys.argv[1]); source = sys.stdin.buffer.read(size); "
    "sys.argv = ['-c', *sys.argv[2:]]; "
    "exec(compile(source, '<sparkdeploy>', 'exec'), {'__name__': '__main__'})"
)

StreamEnd = Literal["exited", "stopped", "timeout", "idle", "lost"]


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    exit_code: int
    stdout: bytes
    stderr: bytes


def stderr_text(result: CommandResult) -> str:
    return result.stderr.decode("utf-8", "replace").strip()[-STDERR_TAIL_CHARS:]


class LineSource(Protocol):
    """The output lines of one running command (Runner.stream_lines), without their line
    endings; iterate it once. `ended` says why it ended, `exit_code` is the command's exit
    status once it has exited."""

    argv: tuple[str, ...]
    exit_code: int | None
    ended: StreamEnd | None

    def __iter__(self) -> Iterator[bytes]: ...
    def close(self) -> None: ...


class Runner(Protocol):
    """What a step needs of a node. An implementation subclasses it explicitly, which gives it
    run_python (a script run through run)."""

    def run(
        self, argv: Sequence[str], *, timeout: float, stdin: bytes | None = None, check: bool = True
    ) -> CommandResult:
        """Run argv on the node; with check, a non-zero exit is an error."""
        ...

    def stream_lines(
        self, argv: Sequence[str], *, timeout: float, idle_timeout: float | None = None
    ) -> LineSource:
        """Start argv on the node and return its output (stdout and stderr merged) as lines,
        ended after `timeout` seconds in all or `idle_timeout` seconds without output."""
        ...

    def run_python(
        self,
        source: str,
        args: Sequence[str],
        *,
        timeout: float,
        stdin: bytes | None = None,
        check: bool = True,
    ) -> CommandResult:
        """Run `source` with the node's python3, standard library only (-I -S: no site
        packages, none of the user's environment, and no site import to pay for at each start);
        sys.argv[1:] = args, stdin follows the source.

        The source travels on stdin ahead of the program's own stdin (its length in argv), so
        its size is not bounded by the kernel's per-argument limit and it needs no quoting.
        """
        encoded = source.encode()
        return self.run(
            ["python3", "-I", "-S", "-c", _PYTHON_BOOTSTRAP, str(len(encoded)), *args],
            timeout=timeout,
            stdin=encoded + (stdin or b""),
            check=check,
        )
