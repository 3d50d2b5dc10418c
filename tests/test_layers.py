"""The layers docs/architecture.md draws hold in the code: no module imports from a layer above
its own (flows > tasks > cli > steps > report > remote > spec > vllm > node > units, secrecy,
errors). A new import that climbs fails here, naming both modules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent
# Top first; a module belongs to the longest prefix that names it.
LAYERS = [
    "flows",
    "tasks",
    "sparkdeploy.cli",
    "sparkdeploy.steps",
    "sparkdeploy.report",
    "sparkdeploy.remote",
    "sparkdeploy.spec",
    "sparkdeploy.vllm",
    "sparkdeploy.node",
    "sparkdeploy.units",
    "sparkdeploy.secrecy",
    "sparkdeploy.errors",
]


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def layer_of(module: str) -> int:
    owners = [layer for layer in LAYERS if module == layer or module.startswith(layer + ".")]
    assert owners, f"{module} is in no layer: add it to LAYERS and to docs/architecture.md"
    return LAYERS.index(max(owners, key=len))


def imported(path: Path, known: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            found |= {name for name in names if name in known}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
    return found


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    paths = {
        module_name(path): path
        for top in ("flows", "tasks", "sparkdeploy")
        for path in (ROOT / top).rglob("*.py")
    }
    # The package's own __init__ is in no layer: it imports nothing of ours.
    known = set(paths) - {"sparkdeploy"}
    climbs = [
        f"{module} imports {target}"
        for module, path in sorted(paths.items())
        if module in known
        for target in sorted(imported(path, known))
        if layer_of(target) < layer_of(module)
    ]
    assert climbs == []
