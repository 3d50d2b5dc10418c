"""Turn a few stdlib-only modules of this package into one script a node's python3 runs.

A node has python3 and nothing else of ours. The script installs each shipped module under its
real name in sys.modules (so `from sparkdeploy.node.engram import ...` works unchanged there) and
then calls the main module's `main(sys.argv[1:])`, whose last stdout line is its JSON answer. The
modules' own files are the only copy of their code: the script embeds their text as on disk,
and the node keeps each module's compiled code in ~/.cache/sparkdeploy/node-code (see
sparkdeploy.node.installer, the script's head).

A script goes to the node on stdin (sparkdeploy.remote.ssh.Connection.run_python) or, for a command
whose output is read as it comes (Connection.stream_lines, which has no stdin), inside its argv
(python_argv).
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import json
import shlex
import zlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Protocol

from sparkdeploy.node import installer

# How much of a failed script's stderr an error message quotes.
STDERR_TAIL_CHARS = 2000


class RunResult(Protocol):
    @property
    def exit_code(self) -> int: ...
    @property
    def stdout(self) -> bytes: ...
    @property
    def stderr(self) -> bytes: ...


class PythonRunner(Protocol):
    """What a node script run through stdin needs: sparkdeploy.remote.ssh.Connection has this
    method."""

    def run_python(
        self,
        source: str,
        args: Sequence[str],
        *,
        timeout: float,
        stdin: bytes | None = None,
        check: bool = True,
    ) -> RunResult: ...


# sshd hands the command to the user's shell as one argument, which Linux bounds at 128 KiB
# (MAX_ARG_STRLEN, including its final NUL).
MAX_COMMAND_BYTES = 128 * 1024 - 1
# Runs the program in argv[1] (zlib-compressed, base64) as __main__ with argv[2:] as its args.
_ARGV_BOOTSTRAP = (
    "import base64, sys, zlib; source = zlib.decompress(base64.b64decode(sys.argv[1])); "
    "sys.argv = ['-c', *sys.argv[2:]]; "
    "exec(compile(source, '<sparkdeploy>', 'exec'), {'__name__': '__main__'})"
)


def build_node_script(
    main: ModuleType, libraries: Sequence[ModuleType] = (), *, write_code_cache: bool = True
) -> str:
    """Source of a script that runs `main.main(argv)` with `libraries` importable by name.

    Every module must import only the standard library and the other shipped modules (a module
    may keep a guarded fallback for a package import, as sparkdeploy.node.engram does for errors).
    write_code_cache=False: the script reads the node's code cache but writes nothing there (a
    preview writes no file on a node).
    """
    lines = [inspect.getsource(installer)]
    if not write_code_cache:
        lines.append("WRITE_CODE_CACHE = False")
    for module in (*libraries, main):
        source = inspect.getsource(module)
        digest = hashlib.sha256(source.encode()).hexdigest()[:32]
        lines.append(f"install({module.__name__!r}, {digest!r}, {source!r})")
    lines.append(f"sys.exit(sys.modules[{main.__name__!r}].main(sys.argv[1:]))")
    return "\n".join(lines) + "\n"


def python_argv(source: str, args: Sequence[str]) -> list[str]:
    """argv that runs `source` with the node's python3 (standard library only: -I -S) and args.

    ValueError if the command would not fit in one shell argument on the node.
    """
    payload = base64.b64encode(zlib.compress(source.encode(), 9)).decode("ascii")
    argv = ["python3", "-I", "-S", "-c", _ARGV_BOOTSTRAP, payload, *args]
    length = len(shlex.join(argv).encode())
    if length > MAX_COMMAND_BYTES:
        raise ValueError(
            f"a node command of {length} bytes exceeds the {MAX_COMMAND_BYTES} bytes a shell "
            "argument may hold; ship less source or pass the large arguments on stdin"
        )
    return argv


def last_json_line(stdout: bytes) -> dict[str, Any] | None:
    """The node script's answer: the last stdout line that is a JSON object."""
    for line in reversed(stdout.decode("utf-8", "replace").strip().splitlines()):
        try:
            answer = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(answer, dict):
            return answer
    return None
