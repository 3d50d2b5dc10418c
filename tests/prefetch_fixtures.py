"""The prefetch tests' fixtures: the lab hub on loopback serving lab-org/tiny, an empty NAS HF
cache, and a cache already holding a repo. A test module asks for them with
`pytest_plugins = ["prefetch_fixtures"]`
(https://docs.pytest.org/en/stable/how-to/plugins.html#requiring-loading-plugins-in-a-test-module-or-conftest-file).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefetch_hub import TINY, put_cached_file

from lab.hub.server import HubServer
from lab.tinymodel import generate_repo
from sparkdeploy.steps.prefetch.hub import HubFile


@pytest.fixture
def cached_repo(tmp_path: Path) -> tuple[Path, list[HubFile]]:
    """A cache holding TINY@SHA (a small file and two LFS files), not yet verified."""
    files = [
        put_cached_file(tmp_path, "config.json", b'{"a": 1}\n', lfs=False),
        put_cached_file(tmp_path, "model-00001.safetensors", os.urandom(3 << 20), lfs=True),
        put_cached_file(tmp_path, "sub/model-00002.safetensors", os.urandom(1 << 20), lfs=True),
    ]
    return tmp_path, files


@pytest.fixture
def repos_dir(tmp_path: Path) -> Path:
    repos = tmp_path / "repos"
    generate_repo(repos, TINY, num_shards=3, total_bytes=3 << 20)
    return repos


@pytest.fixture
def hub(repos_dir: Path) -> Iterator[HubServer]:
    with HubServer(repos_dir) as server:
        yield server


@pytest.fixture
def nas(tmp_path: Path) -> Path:
    path = tmp_path / "nas"
    path.mkdir()
    return path
