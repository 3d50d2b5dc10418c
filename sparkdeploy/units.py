"""Sizes and durations as people read them in logs and artifacts."""

from __future__ import annotations

from datetime import datetime

GIB = 1 << 30


def human_bytes(n: float) -> str:
    """`512 B`, `1.5 KiB`, ...: the largest unit whose figure, as shown, is below 1024 (so a
    size just under a unit shows as 1.0 of it, not 1024.0 of the one below)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        shown = f"{n:.0f}" if unit == "B" else f"{n:.1f}"
        if abs(float(shown)) < 1024 or unit == "TiB":
            return f"{shown} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    """`45 s`, `12 min`, `3 h 5 min`, `2 d 4 h`."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


def ago(moment: datetime, now: datetime) -> str:
    return f"{human_duration((now - moment).total_seconds())} ago"
