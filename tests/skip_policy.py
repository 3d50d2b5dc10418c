"""A lab or real-engine test that skips where the lab can run is a failure, with its reason.

In CI (`CI=true`) and whenever the suite runs as root, the lab can start: a skip there means
something the tests need is missing (a package, a namespace, the engine's runtime), and about
150 tests would pass by not running. Elsewhere (a developer without root) they skip with the
reason, as before. SPARKDEPLOY_ALLOW_LAB_SKIPS=1 lets a person running as root skip them on
purpose. Loaded by conftest.py (`pytest_plugins`).
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

MARKERS = ("lab", "real_engine")
# A test that asks for one of these is a lab test whether or not it is marked.
FIXTURES = frozenset({"lab_cluster", "vllm_runtime", "real_engine"})


def lab_skips_fail() -> bool:
    if os.environ.get("SPARKDEPLOY_ALLOW_LAB_SKIPS") == "1":
        return False
    return os.environ.get("CI") == "true" or os.geteuid() == 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[Any]:
    outcome: Any = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.skipped or not lab_skips_fail():
        return
    fixtures = set(getattr(item, "fixturenames", ()))
    if not any(item.get_closest_marker(m) for m in MARKERS) and not fixtures & FIXTURES:
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    report.outcome = "failed"
    report.longrepr = (
        f"a lab test skipped where the lab must run (CI or root): {reason}. Install what it"
        " names (scripts/setup) or set SPARKDEPLOY_ALLOW_LAB_SKIPS=1 to skip on purpose"
    )
