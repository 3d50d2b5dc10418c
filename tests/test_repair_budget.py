"""The automated repair's hourly bound (unit test)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sparkdeploy.steps.repair_budget import EarlierRepair, repair_refusal

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def test_repairs_are_bounded_per_hour_then_left_for_a_person() -> None:
    def refusal(*minutes_ago: int) -> str | None:
        earlier = [EarlierRepair(f"deploy-{m}", NOW - timedelta(minutes=m)) for m in minutes_ago]
        return repair_refusal(
            "lab-single-1234abcd", "node1 head_exited", earlier, per_hour=2, now=NOW
        )

    assert refusal() is None
    assert refusal(10) is None
    assert refusal(61, 75) is None  # more than an hour ago
    message = refusal(50, 10)
    assert message is not None
    assert "repaired 2 time(s) in the past hour (deploy-50 at 2026-01-01T11:10:00+00:00" in message
    assert "left for a person" in message
    assert "node1 head_exited" in message
