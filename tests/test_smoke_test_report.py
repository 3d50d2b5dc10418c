"""sparkdeploy.steps.smoke_test.report: one failed check fails the report, its table and its error
name it."""

from __future__ import annotations

import pytest

from sparkdeploy.errors import SmokeFailed
from sparkdeploy.steps.smoke_test.report import SmokeCheck, SmokeReport


def test_one_failed_check_fails_the_report_and_names_it() -> None:
    report = SmokeReport(
        "http://127.0.0.1:1",
        "dsv41",
        [
            SmokeCheck("canary_multiply", True, "answered '5461'", {"seconds": 0.25}),
            SmokeCheck("burst", False, "request 3 of 8 went bad", {"requests": 8.0, "good": 2.0}),
        ],
    )
    assert not report.passed
    assert [check.name for check in report.failed] == ["burst"]
    assert report.table_rows()[1] == {
        "check": "burst",
        "result": "FAIL",
        "evidence": "request 3 of 8 went bad",
        "figures": "requests=8, good=2",
    }
    with pytest.raises(SmokeFailed, match="burst: request 3 of 8 went bad"):
        report.raise_if_failed()
    SmokeReport("u", "n", report.checks[:1]).raise_if_failed()
