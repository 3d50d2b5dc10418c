"""The head of every node script: installs the shipped modules under their real names.

sparkdeploy.remote.node_script puts this module's source first in each script it builds, then
one `install(name, digest, source)` per shipped module, then the call of the main module. It runs
in the node's python3 with the standard library only (-I -S).

Compiling the shipped modules at every start cost a node script nearly half its CPU (staging
95 ms, 51 ms with this cache), so each module's code is kept, marshalled, in the SSH user's cache
and loaded from there while the module's text and the node's python3 are the same. A missing,
damaged or unwritable cache only costs the compile; one module keeps one file per python3
version. A script built read-only (node_script.build_node_script(write_code_cache=False), for a
preview that must write nothing on the node) reads the cache but never writes it.
"""

from __future__ import annotations

import marshal
import os
import sys
import types

CODE_CACHE = os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
    "sparkdeploy",
    "node-code",
)
# Set to False by the script's builder, after this module's text, for a script that writes nothing.
WRITE_CODE_CACHE = True


def compiled(name: str, digest: str, source: str) -> types.CodeType:
    """The module's code, from the cache when its digest matches, else compiled and cached."""
    stem = name + "." + format(sys.hexversion, "x") + "."
    path = os.path.join(CODE_CACHE, stem + digest)
    try:
        with open(path, "rb") as cached:
            code = marshal.loads(cached.read())
        if isinstance(code, types.CodeType):
            return code
    except (OSError, EOFError, ValueError, TypeError):
        pass
    code = compile(source, "<shipped " + name + ">", "exec")
    if not WRITE_CODE_CACHE:
        return code
    try:
        os.makedirs(CODE_CACHE, exist_ok=True)
        partial = path + "." + str(os.getpid()) + ".partial"
        with open(partial, "wb") as out:
            out.write(marshal.dumps(code))
        os.replace(partial, path)
        for entry in os.listdir(CODE_CACHE):
            if entry.startswith(stem) and entry != stem + digest and not entry.endswith(".partial"):
                os.remove(os.path.join(CODE_CACHE, entry))
    except OSError:
        pass
    return code


def install(name: str, digest: str, source: str) -> types.ModuleType:
    """Run `source` as the module `name`, its packages made (empty) where the node has none."""
    parts = name.split(".")
    for depth in range(1, len(parts)):
        package = ".".join(parts[:depth])
        if package not in sys.modules:
            parent = types.ModuleType(package)
            parent.__path__ = []
            sys.modules[package] = parent
            if depth > 1:
                setattr(sys.modules[".".join(parts[: depth - 1])], parts[depth - 1], parent)
    module = types.ModuleType(name)
    module.__file__ = "<shipped " + name + ">"
    sys.modules[name] = module
    exec(compiled(name, digest, source), module.__dict__)
    setattr(sys.modules[".".join(parts[:-1])], parts[-1], module)
    return module
