"""Teardown's log handling: stdout/stderr merged in time order, earlier logs kept, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkdeploy.errors import TeardownError
from sparkdeploy.remote.docker_cli import merge_timestamped
from sparkdeploy.steps.teardown import _keep_log


def test_streams_merge_by_timestamp_even_with_trimmed_fractions() -> None:
    stdout = "2026-01-01T00:00:01.5Z out-b\n2026-01-01T00:00:00.25Z out-a\n"
    stderr = "2026-01-01T00:00:01.123456789Z err-b\n2026-01-01T00:00:00.3Z err-a\n"
    merged = merge_timestamped(stdout, stderr).splitlines()
    assert [line.split(" ", 1)[1] for line in merged] == ["out-a", "err-a", "err-b", "out-b"]


def test_an_earlier_log_of_the_node_is_kept_aside(tmp_path: Path) -> None:
    first = _keep_log(str(tmp_path), "dep", "node1", "first boot\n")
    second = _keep_log(str(tmp_path), "dep", "node1", "second boot\n")
    third = _keep_log(str(tmp_path), "dep", "node1", "third boot\n")
    assert first == second == third == tmp_path / "dep" / "node1.log"
    assert third.read_text() == "third boot\n"
    assert (tmp_path / "dep" / "node1.1.log").read_text() == "first boot\n"
    assert (tmp_path / "dep" / "node1.2.log").read_text() == "second boot\n"
    assert sorted(p.name for p in (tmp_path / "dep").iterdir()) == [
        "node1.1.log",
        "node1.2.log",
        "node1.log",
    ]


def test_an_unwritable_runs_dir_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "runs"
    blocker.write_text("a file where the runs dir should be")
    with pytest.raises(TeardownError, match="runs_dir is mounted") as caught:
        _keep_log(str(blocker), "dep", "node1", "log\n")
    assert "node1" in str(caught.value) and str(blocker) in str(caught.value)
