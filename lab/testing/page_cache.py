"""Files in this machine's page cache: how many of their bytes it holds, and dropping them, so a
benchmark reads from disk (cold) and a test sees what a copy left cached."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def drop_from_cache(path: Path) -> None:
    """Flush the file, then drop its pages (DONTNEED drops no dirty ones)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_bytes(*paths: Path) -> int:
    """Page-cache bytes of these files (util-linux fincore)."""
    completed = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return sum(int(line) for line in completed.stdout.split())
