"""Every third-party module the project imports is declared in pyproject.toml, and every
declared runtime dependency is imported by the pipeline (the declaration is the install's truth):
what only the lab imports is its `lab` extra, what only the tests and tools need is `dev`."""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("sparkdeploy", "tasks", "flows", "lab", "bench", "tests", "scripts")
# What a worker host runs: the installed package and the flows and tasks of its checkout.
PIPELINE_DIRS = ("sparkdeploy", "tasks", "flows")
# Imported only inside the real engine's own runtime venv (lab/vllm_runtime.py builds it), never
# by the project's: the model trainer of lab/chat_trainer.py runs there.
RUNTIME_SIDE = frozenset({"torch", "transformers", "tokenizers"})


def _python_files(dirs: tuple[str, ...] = SOURCE_DIRS) -> list[Path]:
    return [path for top in dirs for path in sorted((ROOT / top).rglob("*.py"))]


def _imported_top_level_modules(dirs: tuple[str, ...]) -> dict[str, set[str]]:
    """Absolute imports' top-level modules in the files under `dirs`, each with the files that
    import it."""
    imported: dict[str, set[str]] = {}
    for path in _python_files(dirs):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                imported.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return imported


def _project_module_names() -> set[str]:
    """Modules that are files or packages of this repository (test helpers, the stand-in's
    modules that run with their own directory on sys.path, the packages themselves)."""
    return {path.stem for path in _python_files()} | set(SOURCE_DIRS)


def _declared(extra: str | None = None) -> set[str]:
    """Names of the requirements that apply to this interpreter."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    requirements = [Requirement(line) for line in lines]
    return {
        requirement.name.lower().replace("_", "-")
        for requirement in requirements
        if requirement.marker is None or requirement.marker.evaluate()
    }


def _third_party(dirs: tuple[str, ...] = SOURCE_DIRS) -> dict[str, set[str]]:
    local = _project_module_names()
    return {
        module: files
        for module, files in _imported_top_level_modules(dirs).items()
        if module not in sys.stdlib_module_names
        and module not in local
        and module not in RUNTIME_SIDE
    }


def _distribution(module: str) -> str:
    (name, *_) = packages_distributions()[module]
    return name.lower().replace("_", "-")


def test_every_imported_third_party_module_is_declared() -> None:
    declared = _declared() | _declared("lab") | _declared("dev")
    undeclared = {
        module: sorted(files)
        for module, files in _third_party().items()
        if _distribution(module) not in declared
    }
    assert undeclared == {}, "declare these in pyproject.toml's dependencies"


def test_the_pipeline_needs_only_the_base_dependencies() -> None:
    outside = {
        module: sorted(files)
        for module, files in _third_party(PIPELINE_DIRS).items()
        if _distribution(module) not in _declared()
    }
    assert outside == {}, "declare these in pyproject.toml's dependencies, not in an extra"


def test_every_declared_dependency_is_imported() -> None:
    """A base dependency the pipeline does not import belongs in an extra (`lab`, `dev`); the
    lab extra's are imported by the lab."""
    unused = _declared() - {_distribution(module) for module in _third_party(PIPELINE_DIRS)}
    assert unused == set(), "the pipeline does not import these: move them to an extra"
    by_the_lab = {_distribution(module) for module in _third_party(("lab",))}
    assert _declared("lab") - by_the_lab == set()
