"""CPU accounting for the benchmarks: the lab's nodes, hub and registry share this machine's
cores, so a ratio that is bounded by CPU is reported with the bound measured in the same run."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def busy_cpu_seconds() -> float:
    """CPU time spent not idle, over all cores, since boot (/proc/stat)."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    idle, iowait = fields[3], fields[4]
    return (sum(fields[:8]) - idle - iowait) / _TICKS_PER_S


def cpu_seconds_by_command() -> Counter[tuple[int, str]]:
    """(pid, command name) -> user + system CPU seconds, for every live process."""
    usage: Counter[tuple[int, str]] = Counter()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                text = stat.read()
        except OSError:
            continue  # it ended while we looked
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        usage[(int(entry), name)] = (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
    return usage


@dataclass
class CpuUsage:
    """What one measured stretch cost the machine: wall time, busy CPU time, and by command."""

    wall_s: float = 0.0
    busy_s: float = 0.0
    by_command: Counter[str] = field(default_factory=Counter)

    @property
    def cores_busy(self) -> float:
        return self.busy_s / self.wall_s if self.wall_s else 0.0

    def top(self, count: int = 4) -> str:
        return ", ".join(
            f"{name} {seconds:.2f}" for name, seconds in self.by_command.most_common(count)
        )


@contextmanager
def measured() -> Iterator[CpuUsage]:
    """Fill a CpuUsage with what the body of the `with` cost (processes that ended inside it
    are in busy_s but not in by_command)."""
    usage = CpuUsage()
    per_process = cpu_seconds_by_command()
    busy = busy_cpu_seconds()
    started = time.monotonic()
    try:
        yield usage
    finally:
        usage.wall_s = time.monotonic() - started
        usage.busy_s = busy_cpu_seconds() - busy
        before = {pid: seconds for (pid, _), seconds in per_process.items()}
        for (pid, name), seconds in cpu_seconds_by_command().items():
            # By pid: a kernel worker's name changes with the work it does.
            spent = seconds - before.get(pid, 0.0)
            if spent > 0:
                usage.by_command[name] += spent


def cpu_bound_ratio(small: CpuUsage, large: CpuUsage) -> float:
    """The best wall-time ratio large/small this machine allows when the large run needs its
    measured CPU time and cannot use more than all the cores: max(small's wall, large's CPU /
    cores) / small's wall."""
    cores = os.cpu_count() or 1
    return max(small.wall_s, large.busy_s / cores) / small.wall_s
