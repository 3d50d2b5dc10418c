"""Sizes and durations as logs and artifacts show them (sparkdeploy.units)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from sparkdeploy.units import ago, human_bytes, human_duration

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize(
    ("size", "shown"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (512.4, "512 B"),
        (1023, "1023 B"),
        (KIB, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (MIB, "1.0 MiB"),
        (int(1.5 * GIB), "1.5 GiB"),
        (int(121.63 * GIB), "121.6 GiB"),
        (TIB, "1.0 TiB"),
    ],
)
def test_a_size_takes_the_largest_binary_unit_below_it(size: float, shown: str) -> None:
    assert human_bytes(size) == shown


def test_whole_bytes_have_no_decimals_and_larger_units_one() -> None:
    assert human_bytes(999) == "999 B"
    assert human_bytes(KIB + 1) == "1.0 KiB"
    assert human_bytes(10 * MIB + MIB // 4) == "10.2 MiB"


def test_a_size_just_under_a_unit_shows_as_one_of_it() -> None:
    assert human_bytes(1023.6) == "1.0 KiB"
    assert human_bytes(MIB - 1) == "1.0 MiB"
    assert human_bytes(GIB - KIB) == "1.0 GiB"
    assert human_bytes(-(MIB - 1)) == "-1.0 MiB"
    assert human_bytes(MIB - 52 * KIB) == "972.0 KiB"


def test_sizes_beyond_a_tebibyte_stay_in_tebibytes() -> None:
    assert human_bytes(1 << 50) == "1024.0 TiB"
    assert human_bytes(10**21) == f"{10**21 / TIB:.1f} TiB"


def test_a_negative_size_keeps_its_sign_and_its_unit() -> None:
    # The fit report's headroom is negative when a model does not fit.
    assert human_bytes(-1) == "-1 B"
    assert human_bytes(-1023) == "-1023 B"
    assert human_bytes(-1536) == "-1.5 KiB"
    assert human_bytes(-3 * GIB) == "-3.0 GiB"


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0, "0 s"),
        (0.4, "0 s"),
        (45, "45 s"),
        (59.4, "59 s"),
        (60, "1 min"),
        (12 * 60 + 59, "12 min"),
        (3599, "59 min"),
        (3600, "1 h 0 min"),
        (3 * 3600 + 5 * 60 + 59, "3 h 5 min"),
        (86399, "23 h 59 min"),
        (86400, "1 d 0 h"),
        (2 * 86400 + 4 * 3600 + 59 * 60, "2 d 4 h"),
        (400 * 86400, "400 d 0 h"),
    ],
)
def test_a_duration_shows_its_two_largest_units_rounded_down(seconds: float, shown: str) -> None:
    assert human_duration(seconds) == shown


def test_a_negative_duration_is_shown_as_zero() -> None:
    assert human_duration(-5) == "0 s"
    assert human_duration(-86400 * 3) == "0 s"


def test_ago_is_the_duration_from_a_moment_until_now() -> None:
    now = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
    assert ago(now - timedelta(seconds=30), now) == "30 s ago"
    assert ago(now - timedelta(minutes=90), now) == "1 h 30 min ago"
    assert ago(now - timedelta(days=3, hours=2), now) == "3 d 2 h ago"
    assert ago(now, now) == "0 s ago"


def test_a_moment_after_now_is_no_time_ago() -> None:
    # A clock a little ahead on the machine that stamped the event.
    now = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
    assert ago(now + timedelta(minutes=2), now) == "0 s ago"
