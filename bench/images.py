"""Benchmark: an image onto 3 nodes vs onto 1 node (wall time), and what a re-run moves.

On a 4-node lab: node1 builds an image of the engine stand-in plus a layer of random bytes
(--size) and pushes it to the lab registry; node1 keeps its layers, so the runs use node2..4.
Each round removes the image from the nodes, then times `ensure_image` onto node2 alone and
onto node2..4; the best of --rounds counts. Then a re-run onto node2..4: layers moved (from the
step's report) and bytes received on the nodes' fabric netdevs (SSH's own traffic included).
Targets: 3-node / 1-node time <= 1.5; re-run layers moved = 0.

    .venv/bin/python -m bench.images [--size-mb 200] [--rounds 2] [--lab NAME]
"""

from __future__ import annotations

import argparse
import os
import sys

from bench.cpu import CpuUsage, cpu_bound_ratio, measured
from lab.cluster import Lab
from lab.image import build_engine_image
from lab.layout import FABRIC_NETDEV
from sparkdeploy.remote.ssh import SshTarget, cached_connection, close_cached
from sparkdeploy.steps.image import ensure_image

BENCH_LAB = "bench-images"


def remove_image(targets: dict[str, SshTarget], image: str) -> None:
    for target in targets.values():
        cached_connection(target).run(
            ["docker", "image", "rm", "--force", image], timeout=120, check=False
        )


def received_bytes(targets: dict[str, SshTarget]) -> int:
    total = 0
    for target in targets.values():
        counter = f"/sys/class/net/{FABRIC_NETDEV}/statistics/rx_bytes"
        total += int(cached_connection(target).run(["cat", counter], timeout=30).stdout)
    return total


def timed(targets: dict[str, SshTarget], image: str) -> CpuUsage:
    with measured() as usage:
        ensure_image(targets, image, log=lambda _: None)
    return usage


def make_image(lab: Lab, base: str, size_mb: int) -> str:
    image = f"{lab.registry}/bench/image-{size_mb}mb:1"
    dockerfile = f"FROM {base}\nRUN head -c {size_mb * 1_000_000} /dev/urandom > /blob\n"
    builder = cached_connection(lab.ssh_target("node1"))
    builder.run(["docker", "build", "-t", image, "-"], timeout=600, stdin=dockerfile.encode())
    builder.run(["docker", "push", image], timeout=600)
    return image


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lab", help="an existing lab with >= 4 nodes (default: start one)")
    options = parser.parse_args()
    lab = Lab.existing(options.lab) if options.lab else Lab(BENCH_LAB, 4)
    if not options.lab:
        lab.up()
    try:
        image = make_image(lab, build_engine_image(lab), options.size_mb)
        all_targets = lab.ssh_targets()
        one = {"node2": all_targets["node2"]}
        three = {node: all_targets[node] for node in ("node2", "node3", "node4")}
        one_node, three_nodes = [], []
        for _ in range(options.rounds):
            remove_image(three, image)
            one_node.append(timed(one, image))
            remove_image(three, image)
            before = received_bytes(three)
            three_nodes.append(timed(three, image))
            cold_bytes = received_bytes(three) - before
        before = received_bytes(three)
        rerun = ensure_image(three, image, log=lambda _: None)
        rerun_bytes = received_bytes(three) - before
        best_one = min(one_node, key=lambda usage: usage.wall_s)
        best_three = min(three_nodes, key=lambda usage: usage.wall_s)
        print(f"image: {options.size_mb} MB of random bytes on the engine stand-in")
        for label, runs, best in (
            ("1 node: ", one_node, best_one),
            ("3 nodes:", three_nodes, best_three),
        ):
            rounds = ", ".join(f"{usage.wall_s:.2f}" for usage in runs)
            print(
                f"onto {label} {best.wall_s:.2f} s (rounds {rounds}); CPU {best.busy_s:.2f} s"
                f" ({best.cores_busy:.2f} of {os.cpu_count()} cores busy; {best.top()})"
            )
        print(
            f"3-node / 1-node wall time: {best_three.wall_s / best_one.wall_s:.2f} (target <= 1.5);"
            f" floor set by this machine's CPU: {cpu_bound_ratio(best_one, best_three):.2f}"
            " (the 3-node run's CPU time spread over every core: each node's dockerd unpacks"
            " and hashes its own copy, and the lab's nodes share the machine's cores)"
        )
        print(f"cold pull onto 3 nodes: {cold_bytes / 1e6:.1f} MB received on the fabric")
        print(
            f"re-run: {rerun.layers_moved} layers moved (target 0), actions"
            f" {[node.action for node in rerun.nodes]}, {rerun_bytes / 1e3:.1f} kB received"
            f" (SSH and docker CLI traffic), {rerun.seconds:.2f} s"
        )
    finally:
        close_cached()
        if not options.lab:
            lab.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
