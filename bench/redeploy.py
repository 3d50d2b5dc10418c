"""Warm redeploy on the lab: orchestration overhead beyond the engine's own time to ready.

A lab of the largest node count comes up; for each count (default 3 and 6) the DSV4.1-shaped
lab recipe (at TP = nodes, on the lab's first nodes) is deployed once cold and torn down, then
each round deploys every size warm, in turn, with everything staged and pulled: a warm deploy's
wall time minus the engine's time to ready (the readiness gate's figure, from the gate's start
to /v1/models answering) is its overhead. Prints each run's CPU and the time the
hypervisor stole, the median overhead per size and the ratio of the largest to the smallest,
overall and by round (targets: 3 nodes <= 0.7 s, 6 nodes <= 1.3x the 3-node figure). Runs
against its own local Prefect server, on SQLite or on a PostgreSQL database of its own
(--database); needs root.

    .venv/bin/python -m bench.redeploy [--nodes 3,6] [--rounds 2] [--database sqlite|postgresql]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.cpu import measured
from lab.cluster import Lab
from lab.image import build_engine_image
from lab.models import publish_lab_models
from lab.postgres import PostgresServer
from lab.prefect_local import PROJECT_ROOT, PrefectServer, free_port
from sparkdeploy.spec.project import lab_root

RECIPE = PROJECT_ROOT / "recipes" / "lab-dsv41-3x" / "recipe.toml"
ENGRAM_DIR = "/var/tmp/engram-local/tiny-dsv41"


def sized_recipe(directory: Path, nodes: int) -> str:
    text = RECIPE.read_text()
    for key in ("required_nodes", "tensor_parallel_size"):
        text = text.replace(f"{key} = 3", f"{key} = {nodes}", 1)
    text = text.replace('"draft_tensor_parallel_size":3', f'"draft_tensor_parallel_size":{nodes}')
    # Each size stages its own ranks' Engram copies: sharing one path, every deploy of the other
    # size would copy them again and none would be warm.
    if f"{ENGRAM_DIR}/" not in text:
        raise SystemExit(f"{RECIPE} no longer keeps its Engram copies in {ENGRAM_DIR}/")
    text = text.replace(f"{ENGRAM_DIR}/", f"{ENGRAM_DIR}-{nodes}x/")
    path = directory / f"bench-dsv41-{nodes}x" / "recipe.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path.parent)


@dataclass(frozen=True)
class Overhead:
    measured_s: float
    floor_s: float  # CPU time / cores - the engine's time: what all cores busy would leave


def measure(sizes: list[int], rounds: int, workdir: Path) -> dict[int, list[Overhead]]:
    """Warm-redeploy overheads by deployment size, all on one lab of the largest size.

    The sizes take turns within each round, so a stretch of a noisy host (a VM's steal time
    comes and goes) weighs on every size alike instead of on whichever was measured then.
    """
    from flows.deploy import deploy
    from flows.teardown import teardown

    lab = Lab(f"bench{max(sizes)}", max(sizes))
    lab.up()
    try:
        build_engine_image(lab)
        publish_lab_models(lab.hub_repos_dir)
        cluster = str(lab.inventory_path)
        recipes = {size: sized_recipe(workdir, size) for size in sizes}
        for recipe in recipes.values():
            deploy(recipe, cluster=cluster)  # cold: prefetch, staging, pulls
            teardown(recipe, cluster=cluster)
        overheads: dict[int, list[Overhead]] = {size: [] for size in sizes}
        cores = os.cpu_count() or 1
        for round_number in range(1, rounds + 1):
            for size, recipe in recipes.items():
                with measured() as usage:
                    summary = deploy(recipe, cluster=cluster)
                wall = usage.wall_s
                engine = summary.ready_after_s or 0.0
                floor = usage.busy_s / cores - engine
                overheads[size].append(Overhead(wall - engine, floor))
                steps = ", ".join(f"{k} {v:.1f}" for k, v in summary.step_seconds.items())
                print(
                    f"  {size} nodes, warm round {round_number}: wall {wall:.2f} s, engine ready"
                    f" {engine:.2f} s, overhead {wall - engine:.2f} s (the machine's floor"
                    f" {floor:.2f} s; {steps});"
                    f" CPU {usage.busy_s:.2f} s, {usage.cores_busy:.2f} of {os.cpu_count()}"
                    f" cores busy ({usage.top(5)}); stolen by the hypervisor"
                    f" {usage.stolen_s:.2f} s",
                    flush=True,
                )
                teardown(recipe, cluster=cluster)
        return overheads
    finally:
        lab.down()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="3,6", help="comma-separated lab sizes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--database", choices=("sqlite", "postgresql"), default="sqlite")
    options = parser.parse_args()
    sizes = [int(size) for size in options.nodes.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-redeploy-") as scratch:
        workdir = Path(scratch)
        database = None
        database_url = None
        if options.database == "postgresql":
            # Under the lab root: PostgreSQL's user cannot enter a private temporary directory.
            database = PostgresServer(lab_root() / "postgres" / "bench-redeploy", free_port())
            database.start()
            database.create_database("prefect")
            database_url = database.database_url("prefect")
        server = PrefectServer(workdir / "prefect", port=free_port(), database_url=database_url)
        try:
            server.start()
            os.environ.update({k: v for k, v in server.env().items() if k.startswith("PREFECT_")})
            overheads = measure(sizes, options.rounds, workdir)
        finally:
            server.stop()
            if database is not None:
                database.remove()
    medians = {
        size: statistics.median(value.measured_s for value in values)
        for size, values in overheads.items()
    }
    for size, overhead in medians.items():
        floor = statistics.median(value.floor_s for value in overheads[size])
        print(
            f"warm redeploy overhead, {size} nodes: {overhead:.2f} s (median; the machine's floor"
            f" {floor:.2f} s)"
        )
    if len(sizes) > 1:
        smallest, largest = min(sizes), max(sizes)
        paired = zip(overheads[smallest], overheads[largest], strict=True)
        per_round = ", ".join(
            f"{large.measured_s / small.measured_s:.2f}" for small, large in paired
        )
        print(
            f"overhead ratio {largest}/{smallest} nodes: "
            f"{medians[largest] / medians[smallest]:.2f} (target <= 1.3); by round {per_round}"
        )
    print(f"target ({options.database}): overhead <= 0.7 s on 3 nodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
