"""A Prefect test server for the whole session, its state in a temporary PREFECT_HOME.

Start-up costs about 20 s (FACTS.md), so it happens once. Use the `prefect_harness` fixture;
a conftest may register this module with `pytest_plugins = ["prefect_harness"]` so that every
test module shares the one server.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("prefect-home")
    # Set before Prefect reads its settings (the test server is a subprocess and inherits them):
    # results and local storage go under this home, and the server sends no telemetry (tests
    # talk to loopback only).
    os.environ["PREFECT_HOME"] = str(home)
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    from prefect.settings import PREFECT_HOME, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with temporary_settings({PREFECT_HOME: home}), prefect_test_harness(server_startup_timeout=120):
        yield home
