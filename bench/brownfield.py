"""Benchmark: the first deploy on a brownfield lab against the same deploy on a clean one.

A 3-node lab comes up with its own local Prefect server (needs root). Each round, in turn:
- brownfield: lab/brownfield.py's make_brownfield puts the lab in the state the old launcher
  leaves for recipes/lab-dsv41-brownfield (the NAS cache filled by snapshot_download, hand-made
  Engram copies hardlinked by another lane, the image under a :local tag on every node, a
  container that is not ours), then the deploy flow runs in this process: it adopts all of it;
- clean: the NAS repos and the node copies (with their manifests and the other lane's links)
  are removed, then the same deploy runs: it fetches from the lab hub and copies the Engram
  ranks. The image stays: its :local tag is in no registry, and the brownfield deploy builds or
  pulls nothing either.
Each deploy is torn down after it is timed. One clean deploy before the rounds is not counted:
the first deploy of a process and of a fresh lab pays one-time costs (imports, the flows'
registration with the server, the nodes' first SSH sessions) that a first deploy on a cluster
run by a team's long-lived worker does not. Prints each deploy's wall time, the steps' times
(prefetch and stage-engram are where the two differ), the CPU and the time stolen, and the
ratio clean / brownfield of the best of each (the brownfield deploy hashes what is there where
the clean one fetches and copies it; the lab's models are small, so the engine's own start
weighs most in both).

    .venv/bin/python -m bench.brownfield [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from bench.cpu import CpuUsage, measured
from lab.brownfield import (
    BROWNFIELD_RECIPE,
    Brownfield,
    clear_brownfield,
    make_brownfield,
)
from lab.cluster import Lab
from lab.image import build_engine_image
from lab.models import publish_lab_models
from lab.prefect_local import PrefectServer, free_port
from sparkdeploy.node.hfcache import repo_dir
from sparkdeploy.spec.cluster import load_cluster

RECIPE = str(BROWNFIELD_RECIPE)
NODES = 3


def clean_state(lab: Lab, field: Brownfield) -> None:
    """What a cluster never deployed to holds: no NAS repo, no Engram copy on any node."""
    nas = load_cluster(lab.inventory_path).nas.hf_cache
    for repo in field.nas_repos:
        shutil.rmtree(repo_dir(nas, repo))
    for copy in field.copies:
        target = lab.node_path(copy.node, copy.dest)
        # The copy, its manifest and any partial copy or journal beside it.
        for path in target.parent.glob(f"{target.name}*"):
            path.unlink()
        lab.node_path(copy.node, copy.lane_link).unlink()


def timed_deploy(lab: Lab, label: str) -> CpuUsage:
    from flows.deploy import deploy
    from flows.teardown import teardown

    cluster = str(lab.inventory_path)
    with measured() as usage:
        summary = deploy(RECIPE, cluster=cluster)
    # "; ": a key names the steps that run at once, joined by ", ".
    steps = "; ".join(f"{step} {seconds:.1f}" for step, seconds in summary.step_seconds.items())
    print(
        f"  {label}: {usage.wall_s:.2f} s ({steps}); engine ready"
        f" {summary.ready_after_s or 0.0:.2f} s; CPU {usage.busy_s:.2f} s"
        f" ({usage.top(4)}); stolen {usage.stolen_s:.2f} s",
        flush=True,
    )
    teardown(RECIPE, cluster=cluster)
    return usage


def measure(rounds: int) -> tuple[list[CpuUsage], list[CpuUsage]]:
    lab = Lab("benchbf", NODES)
    lab.up()
    try:
        build_engine_image(lab)
        publish_lab_models(lab.hub_repos_dir)
        # make_brownfield also puts the recipe's :local image on the nodes.
        clean_state(lab, make_brownfield(lab, RECIPE))
        timed_deploy(lab, "warm-up, clean, not counted")
        brownfield: list[CpuUsage] = []
        clean: list[CpuUsage] = []
        for round_number in range(1, rounds + 1):
            print(f"round {round_number}:", flush=True)
            field = make_brownfield(lab, RECIPE)
            brownfield.append(timed_deploy(lab, "brownfield (adopts)"))
            clean_state(lab, field)
            clean.append(timed_deploy(lab, "clean (fetches and copies)"))
            clear_brownfield(lab, field)
        return brownfield, clean
    finally:
        lab.down()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-brownfield-") as scratch:
        server = PrefectServer(Path(scratch) / "prefect", port=free_port())
        try:
            server.start()
            os.environ.update({k: v for k, v in server.env().items() if k.startswith("PREFECT_")})
            brownfield, clean = measure(options.rounds)
        finally:
            server.stop()
    best_brownfield = min(usage.wall_s for usage in brownfield)
    best_clean = min(usage.wall_s for usage in clean)
    print(
        f"first deploy, best of {options.rounds}: brownfield {best_brownfield:.2f} s, clean"
        f" {best_clean:.2f} s; ratio clean/brownfield = {best_clean / best_brownfield:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
