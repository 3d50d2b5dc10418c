"""The wheel installs the package `sparkdeploy` alone, whole (its modules and their data): the
flows, tasks, lab and benchmarks run from the checkout, and top-level names as generic as
`flows` or `lab` would collide with other projects'. What only the lab imports is its `lab`
extra, not a dependency of the package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "sparkdeploy"
# Not read by the build: VCS, venv and tool caches, earlier build output, benchmark results.
UNREAD = frozenset({"__pycache__", "build", "dist", "results"})
BUILD_TIMEOUT_S = 300


def _unread(directory: str, names: list[str]) -> set[str]:
    return {
        name
        for name in names
        if name.startswith(".") or name in UNREAD or name.endswith(".egg-info")
    }


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout to build from: a build writes build/ and egg-info beside the
    sources, which a concurrent run of the suite would trip over."""
    copy = tmp_path_factory.mktemp("packaging") / "checkout"
    shutil.copytree(ROOT, copy, ignore=_unread, symlinks=True)
    return copy


@pytest.fixture(scope="module")
def wheel(checkout: Path) -> zipfile.ZipFile:
    """The wheel pip builds from the checkout's copy."""
    out = checkout.parent
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(checkout)],
        check=True,
        capture_output=True,
        timeout=BUILD_TIMEOUT_S,
    )
    [built] = out.glob(f"{PACKAGE}-*.whl")
    return zipfile.ZipFile(built)


def _metadata(wheel: zipfile.ZipFile) -> list[Requirement]:
    [name] = [name for name in wheel.namelist() if name.endswith(".dist-info/METADATA")]
    metadata = Parser().parsestr(wheel.read(name).decode())
    return [Requirement(line) for line in metadata.get_all("Requires-Dist") or []]


def _names(requirements: list[Requirement]) -> set[str]:
    return {requirement.name for requirement in requirements}


def test_the_wheel_installs_only_the_package(wheel: zipfile.ZipFile) -> None:
    top_level = {name.split("/")[0] for name in wheel.namelist()}
    dist_info = {name for name in top_level if name.endswith(".dist-info")}
    assert top_level - dist_info == {PACKAGE}
    assert [name.split("-")[0] for name in dist_info] == [PACKAGE]


def test_the_wheel_holds_every_file_of_the_package(checkout: Path, wheel: zipfile.ZipFile) -> None:
    in_checkout = {
        path.relative_to(checkout).as_posix()
        for path in (checkout / PACKAGE).rglob("*")
        if path.is_file()
    }
    in_wheel = {name for name in wheel.namelist() if name.startswith(f"{PACKAGE}/")}
    assert in_checkout - in_wheel == set(), "add them to [tool.setuptools] in pyproject.toml"


def test_the_wheel_has_the_command(wheel: zipfile.ZipFile) -> None:
    [name] = [name for name in wheel.namelist() if name.endswith(".dist-info/entry_points.txt")]
    assert "sparkdeploy = sparkdeploy.cli:app" in wheel.read(name).decode().splitlines()


def test_the_lab_imports_are_its_extra_not_the_package_dependencies(
    wheel: zipfile.ZipFile,
) -> None:
    requirements = _metadata(wheel)
    base = _names([r for r in requirements if r.marker is None or "extra" not in str(r.marker)])
    lab = _names([r for r in requirements if r.marker and r.marker.evaluate({"extra": "lab"})])
    assert {"docker", "cryptography"} <= lab
    assert {"docker", "cryptography"}.isdisjoint(base)
