"""Lab up and down: seconds, memory of everything the lab runs, and what is left afterwards.

    python -m bench.lab_up_down [--nodes 3] [--rounds 3] [--name bench]

Memory is summed over every process in the lab's namespaces (registry, per node sshd, dockerd,
containerd) while idle: RSS (counts shared pages once per process) and PSS (shares them out).
Targets from issue 3: up <= 5 s, <= 600 MiB, down <= 5 s leaving nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from lab.cluster import Lab
from lab.network import netns_pids

MIB = 1024 * 1024


def lab_pids(lab: Lab) -> set[int]:
    names = [lab.layout.bridge_netns, *(lab.layout.node_netns(node) for node in lab.nodes)]
    return {pid for name in names for pid in netns_pids(name)}


def memory_bytes(pids: set[int]) -> tuple[int, int]:
    rss = pss = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                field, value, *_ = [*line.split(), ""]
                if field == "Rss:":
                    rss += int(value) * 1024
                elif field == "Pss:":
                    pss += int(value) * 1024
        except (FileNotFoundError, ProcessLookupError):
            continue
    return rss, pss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="bench")
    options = parser.parse_args()
    lab = Lab(options.name, options.nodes)
    ups, downs, rss_values, pss_values, process_counts = [], [], [], [], []
    for _ in range(options.rounds):
        ups.append(lab.up())
        time.sleep(1)  # let the daemons settle to their idle footprint
        pids = lab_pids(lab)
        rss, pss = memory_bytes(pids)
        rss_values.append(rss)
        pss_values.append(pss)
        process_counts.append(len(pids))
        downs.append(lab.down())
        remains = lab.remains()
        if remains:
            raise SystemExit(f"lab down left {remains}")
    print(f"lab {options.name!r}, {options.nodes} nodes, {options.rounds} rounds")
    print(f"up    median {statistics.median(ups):.2f} s  (max {max(ups):.2f}; target <= 5)")
    print(f"down  median {statistics.median(downs):.2f} s  (max {max(downs):.2f}; target <= 5)")
    print(
        f"idle  {max(process_counts)} processes, RSS {max(rss_values) / MIB:.0f} MiB,"
        f" PSS {max(pss_values) / MIB:.0f} MiB (target <= 600)"
    )
    print("left after down: nothing (netns, cgroup dirs, links, mounts, state dir all gone)")


if __name__ == "__main__":
    main()
