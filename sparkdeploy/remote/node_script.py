"""Turn a few stdlib-only modules of this package into one script a node's python3 runs.

A node has python3 and nothing else of ours. The script ships a main module and every module of
this package it imports, directly or through another (shipped_modules), installs each under its
real name in sys.modules (so `from sparkdeploy.node.engram import ...` works unchanged there) and
then calls the main module's `main(sys.argv[1:])`, whose last stdout line is its JSON answer. The
modules' own files are the only copy of their code: the script embeds their text as on disk,
and the node keeps each module's compiled code in ~/.cache/sparkdeploy/node-code (see
sparkdeploy.node.installer, the script's head).

A script goes to the node on stdin (sparkdeploy.remote.runner.Runner.run_python) or, for a
command whose output is read as it comes (Runner.stream_lines, which has no stdin), inside its
argv (python_argv).
"""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib
import inspect
import json
import shlex
import threading
import zlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from sparkdeploy.errors import RemoteError
from sparkdeploy.node import installer
from sparkdeploy.remote.runner import CommandResult, stderr_text

# What a shipped module imports of this package is shipped with it; the rest must be stdlib.
_PACKAGE = __name__.split(".")[0]

# sshd hands the command to the user's shell as one argument, which Linux bounds at 128 KiB
# (MAX_ARG_STRLEN, including its final NUL).
MAX_COMMAND_BYTES = 128 * 1024 - 1
# Runs the program in argv[1] (zlib-compressed, base64) as __main__ with argv[2:] as its args.
_ARGV_BOOTSTRAP = (
    "import base64, sys, zlib; source = zlib.decompress(base64.b64decode(sys.argv[1])); "
    "sys.argv = ['-c', *sys.argv[2:]]; "
    "exec(compile(source, '<sparkdeploy>', 'exec'), {'__name__': '__main__'})"
)


def build_node_script(main: ModuleType, *, write_code_cache: bool = True) -> str:
    """Source of a script that runs `main.main(argv)` with the modules it imports importable by
    name (shipped_modules).

    Every shipped module must import only the standard library and modules of this package that
    do likewise (sparkdeploy.node's, sparkdeploy.errors); a module may keep a guarded fallback
    for a copy outside the package, as sparkdeploy.node.engram does in the lab's engine image.
    write_code_cache=False: the script reads the node's code cache but writes nothing there (a
    preview writes no file on a node).
    """
    lines = [inspect.getsource(installer)]
    if not write_code_cache:
        lines.append("WRITE_CODE_CACHE = False")
    for module in shipped_modules(main):
        source = inspect.getsource(module)
        digest = hashlib.sha256(source.encode()).hexdigest()[:32]
        lines.append(f"install({module.__name__!r}, {digest!r}, {source!r})")
    lines.append(f"sys.exit(sys.modules[{main.__name__!r}].main(sys.argv[1:]))")
    return "\n".join(lines) + "\n"


def shipped_modules(main: ModuleType) -> list[ModuleType]:
    """`main` and every module of this package it imports, directly or through another, each
    after the modules it imports (main last), as its script installs them.

    The imports are read from each module's text, wherever they stand (a function's too); the
    package's __init__ modules hold nothing, the node script makes them empty.
    """
    ordered: list[ModuleType] = []
    seen = {main.__name__}

    def visit(module: ModuleType) -> None:
        for imported in _package_imports(module):
            if imported.__name__ not in seen:
                seen.add(imported.__name__)
                visit(imported)
        ordered.append(module)

    visit(main)
    return ordered


# CPython 3.11's AST conversion keeps its recursion depth in process-wide state: two threads
# parsing at once can fail with "SystemError: AST constructor recursion depth mismatch" (seen
# when a step built its node script on three node threads at once). So each module is parsed
# once, one thread at a time, and its imported names kept.
_PARSE_LOCK = threading.Lock()
_imported_names: dict[str, list[str]] = {}


def _package_imports(module: ModuleType) -> list[ModuleType]:
    """The modules (not packages) of this package that `module` imports, its top-level imports
    first."""
    with _PARSE_LOCK:
        names = _imported_names.get(module.__name__)
        if names is None:
            names = _imported_names[module.__name__] = _names_imported(module)
    found = [_module_named(name) for name in names if name.startswith(_PACKAGE + ".")]
    return [imported for imported in found if imported is not None]


def _names_imported(module: ModuleType) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


def _module_named(name: str) -> ModuleType | None:
    """The module of that name; None for a package or a name inside a module (the `name` of
    `from package.module import name`)."""
    try:
        found = importlib.import_module(name)
    except ModuleNotFoundError:
        return None
    return None if hasattr(found, "__path__") else found


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


def script_answer(
    completed: CommandResult, node: str, script: str, *, advice: str = ""
) -> dict[str, Any]:
    """The answer of `script` (last_json_line); RemoteError with its exit status, `advice` and its
    stderr's tail when it gave none."""
    answer = last_json_line(completed.stdout)
    if answer is None:
        raise RemoteError(
            f"node {node}: {script} exited {completed.exit_code} without an answer; "
            f"{f'{advice}; ' if advice else ''}stderr ends with: {stderr_text(completed)}"
        )
    return answer
