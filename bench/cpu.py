"""CPU accounting for the benchmarks: the lab's nodes, hub and registry share this machine's
cores, so a ratio that is bounded by CPU is reported with the bound measured in the same run."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def busy_and_stolen_cpu_seconds() -> tuple[float, float]:
    """CPU time spent running this machine's work, and time the hypervisor gave to other guests
    while this one had work (steal), over all cores, since boot (/proc/stat)."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (
            int(value) for value in stat.readline().split()[1:9]
        )
    return (user + nice + system + irq + softirq) / _TICKS_PER_S, steal / _TICKS_PER_S


def cpu_seconds_by_command() -> dict[tuple[int, str], float]:
    """(pid, command name) -> user + system CPU seconds, for every live process."""
    usage: dict[tuple[int, str], float] = {}
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
    """What one measured stretch cost the machine: wall time, busy CPU time, and by command;
    stolen_s is CPU time the hypervisor withheld, which makes wall times on a shared VM noisy."""

    wall_s: float = 0.0
    busy_s: float = 0.0
    stolen_s: float = 0.0
    by_command: dict[str, float] = field(default_factory=dict)

    @property
    def cores_busy(self) -> float:
        return self.busy_s / self.wall_s if self.wall_s else 0.0

    def top(self, count: int = 4) -> str:
        largest = sorted(self.by_command.items(), key=lambda item: item[1], reverse=True)
        return ", ".join(f"{name} {seconds:.2f}" for name, seconds in largest[:count])


@contextmanager
def measured() -> Iterator[CpuUsage]:
    """Fill a CpuUsage with what the body of the `with` cost (processes that ended inside it
    are in busy_s but not in by_command)."""
    usage = CpuUsage()
    per_process = cpu_seconds_by_command()
    busy, stolen = busy_and_stolen_cpu_seconds()
    started = time.monotonic()
    try:
        yield usage
    finally:
        usage.wall_s = time.monotonic() - started
        busy_after, stolen_after = busy_and_stolen_cpu_seconds()
        usage.busy_s = busy_after - busy
        usage.stolen_s = stolen_after - stolen
        before = {pid: seconds for (pid, _), seconds in per_process.items()}
        for (pid, name), seconds in cpu_seconds_by_command().items():
            # By pid: a kernel worker's name changes with the work it does.
            spent = seconds - before.get(pid, 0.0)
            if spent > 0:
                usage.by_command[name] = usage.by_command.get(name, 0.0) + spent


def cpu_bound_ratio(small: CpuUsage, large: CpuUsage) -> float:
    """The best wall-time ratio large/small this machine allows when the large run needs its
    measured CPU time and cannot use more than all the cores: max(small's wall, large's CPU /
    cores) / small's wall."""
    cores = os.cpu_count() or 1
    return max(small.wall_s, large.busy_s / cores) / small.wall_s
