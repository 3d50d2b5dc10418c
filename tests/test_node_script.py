from __future__ import annotations

import importlib.util
import marshal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest

from lab.testing.local_node import NODE_ENV
from sparkdeploy.node import engram_copy
from sparkdeploy.remote import node_script
from sparkdeploy.remote.node_script import build_node_script, python_argv, shipped_modules

GREETER = """\
import sys


def main(argv):
    print("hello " + argv[0])
    return 0
"""


def shipped_module(directory: Path, source: str, name: str = "shiptest.greeter") -> ModuleType:
    """A module of `source` loaded from a file, as build_node_script reads this package's."""
    path = directory / f"{name.rpartition('.')[2]}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_on_node(script: str, cache_home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        python_argv(script, args),
        env={**NODE_ENV, "XDG_CACHE_HOME": str(cache_home)},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )


def cached_files(cache_home: Path) -> list[Path]:
    return sorted((cache_home / "sparkdeploy" / "node-code").iterdir())


def test_a_shipped_modules_code_is_compiled_once_then_loaded(tmp_path: Path) -> None:
    script = build_node_script(shipped_module(tmp_path, GREETER))
    cache_home = tmp_path / "cache"
    assert run_on_node(script, cache_home, "node1").stdout == "hello node1\n"
    [cached] = cached_files(cache_home)
    node_python = subprocess.run(
        ["python3", "-I", "-S", "-c", "import sys; print(format(sys.hexversion, 'x'))"],
        env=NODE_ENV,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert cached.name.startswith(f"shiptest.greeter.{node_python}.")
    # What the cache holds is what runs: the module is not compiled again.
    impostor = compile('def main(argv):\n    print("cached " + argv[0])\n', "impostor", "exec")
    cached.write_bytes(marshal.dumps(impostor))
    assert run_on_node(script, cache_home, "node1").stdout == "cached node1\n"


def test_a_changed_module_replaces_its_cached_code(tmp_path: Path) -> None:
    cache_home = tmp_path / "cache"
    run_on_node(build_node_script(shipped_module(tmp_path, GREETER)), cache_home, "a")
    [old] = cached_files(cache_home)
    changed = build_node_script(shipped_module(tmp_path, GREETER.replace("hello", "hi")))
    assert run_on_node(changed, cache_home, "b").stdout == "hi b\n"
    [new] = cached_files(cache_home)
    assert new != old


def test_a_damaged_or_unwritable_cache_only_costs_the_compile(tmp_path: Path) -> None:
    script = build_node_script(shipped_module(tmp_path, GREETER))
    cache_home = tmp_path / "cache"
    run_on_node(script, cache_home, "a")
    [cached] = cached_files(cache_home)
    cached.write_bytes(b"\x00 not marshal data")
    assert run_on_node(script, cache_home, "b").stdout == "hello b\n"
    assert marshal.loads(cached.read_bytes()).co_filename == "<shipped shiptest.greeter>"
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    assert run_on_node(script, not_a_directory, "c").stdout == "hello c\n"


def test_a_script_ships_every_module_of_ours_its_main_imports_first() -> None:
    shipped = [module.__name__ for module in shipped_modules(engram_copy)]
    assert set(shipped) == {
        "sparkdeploy.errors",
        "sparkdeploy.node.engram",
        "sparkdeploy.node.hfcache",
        "sparkdeploy.node.staged_file",
        "sparkdeploy.node.engram_plan",
        "sparkdeploy.node.sparse_copy",
        "sparkdeploy.node.engram_adopt",
        "sparkdeploy.node.engram_copy",
    }
    # Installed in this order on the node, so each after the modules it imports.
    order = ["errors", "node.engram", "node.engram_plan", "node.sparse_copy", "node.engram_adopt"]
    positions = [shipped.index(f"sparkdeploy.{name}") for name in order]
    assert positions == sorted(positions)
    assert shipped[-1] == "sparkdeploy.node.engram_copy"


def test_scripts_built_on_many_threads_at_once_are_all_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step builds its node script on one thread per node, the first time at once: each gets
    the whole script (CPython 3.11 cannot parse on two threads at once)."""
    expected = build_node_script(engram_copy)
    for _ in range(20):
        monkeypatch.setattr(node_script, "_imported_names", {})
        with ThreadPoolExecutor(max_workers=8) as pool:
            built = list(pool.map(lambda _: build_node_script(engram_copy), range(8)))
        assert built == [expected] * 8


HELPER = 'GREETING = "hello from a helper,"\n'
GREETER_WITH_HELPER = """\
def main(argv):
    from sparkdeploy.node.shiptest_helper import GREETING

    print(GREETING, argv[0])
    return 0
"""


def test_a_module_imported_inside_a_function_is_shipped_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    helper = shipped_module(tmp_path, HELPER, "sparkdeploy.node.shiptest_helper")
    monkeypatch.setitem(sys.modules, helper.__name__, helper)
    main = shipped_module(tmp_path, GREETER_WITH_HELPER, "sparkdeploy.node.shiptest_greeter")
    assert shipped_modules(main) == [helper, main]
    answer = run_on_node(build_node_script(main), tmp_path / "cache", "node1")
    assert answer.stdout == "hello from a helper, node1\n"
