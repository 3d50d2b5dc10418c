"""skip_policy: in CI or as root a lab or real-engine test that skips fails, naming its reason;
other tests' skips, and lab skips allowed on purpose, stay skips."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

SUITE = """
import pytest

@pytest.mark.lab
def test_on_the_lab():
    pytest.skip("no network namespaces here")

@pytest.mark.real_engine
def test_on_real_vllm():
    pytest.skip("the CPU build is not installed")

def test_elsewhere():
    pytest.skip("not a lab test")

@pytest.fixture
def lab_cluster():
    pytest.skip("the lab cannot start")

def test_unmarked_on_the_lab(lab_cluster):
    pass
"""


def _run(pytester: pytest.Pytester) -> pytest.RunResult:
    pytester.makeini("[pytest]\nmarkers =\n    lab: l\n    real_engine: r\n")
    pytester.makepyfile(SUITE)
    return pytester.runpytest("-p", "skip_policy", "-rA")


def test_lab_skips_fail_in_ci_with_their_reason(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    monkeypatch.delenv("SPARKDEPLOY_ALLOW_LAB_SKIPS", raising=False)
    result = _run(pytester)
    result.assert_outcomes(failed=2, skipped=1, errors=1)
    result.stdout.fnmatch_lines(["*lab test skipped where the lab must run*no network namespaces*"])


def test_lab_skips_allowed_on_purpose_stay_skips(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("SPARKDEPLOY_ALLOW_LAB_SKIPS", "1")
    _run(pytester).assert_outcomes(skipped=4)
