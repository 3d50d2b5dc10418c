"""Turn a few stdlib-only modules of this package into one script a node's python3 runs.

A node has python3 and nothing else of ours. The script installs each shipped module under its
real name in sys.modules (so `from sparkdeploy.engram import ...` works unchanged there) and then
calls the main module's `main(sys.argv[1:])`, whose last stdout line is its JSON answer. The
modules' own files are the only copy of their code: the script embeds their text as on disk.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from types import ModuleType
from typing import Any

# How much of a failed script's stderr an error message quotes.
STDERR_TAIL_CHARS = 2000

_INSTALLER = """\
import sys
import types


def _install(name, source):
    package, _, leaf = name.rpartition(".")
    if package not in sys.modules:
        parent = types.ModuleType(package)
        parent.__path__ = []
        sys.modules[package] = parent
    module = types.ModuleType(name)
    module.__file__ = "<shipped " + name + ">"
    sys.modules[name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    setattr(sys.modules[package], leaf, module)
    return module

"""


def build_node_script(main: ModuleType, libraries: Sequence[ModuleType] = ()) -> str:
    """Source of a script that runs `main.main(argv)` with `libraries` importable by name.

    Every module must import only the standard library and the other shipped modules (a module
    may keep a guarded fallback for a package import, as sparkdeploy.engram does for errors).
    """
    lines = [_INSTALLER]
    for module in (*libraries, main):
        lines.append(f"_install({module.__name__!r}, {inspect.getsource(module)!r})")
    lines.append(f"sys.exit(sys.modules[{main.__name__!r}].main(sys.argv[1:]))")
    return "\n".join(lines) + "\n"


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
