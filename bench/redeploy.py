"""Warm redeploy on the lab: orchestration overhead beyond the engine's own time to ready.

For each node count (default 3 and 6) a lab of that size comes up, the DSV4.1-shaped lab recipe
(at TP = nodes) is deployed once cold and torn down, then deployed again with everything staged
and pulled: that warm deploy's wall time minus the engine's time to ready (the readiness gate's
figure, from the containers' start to /v1/models answering) is the overhead. Prints the overhead
per size and the ratio of the largest to the smallest (targets: 3 nodes <= 5 s, 6 nodes <= 1.3x
the 3-node figure). Runs against its own local Prefect server; needs root.

    .venv/bin/python bench/redeploy.py [--nodes 3,6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:1] = [str(REPO_ROOT)]

from bench.cpu import measured  # noqa: E402
from lab.cluster import Lab  # noqa: E402
from lab.image import build_engine_image  # noqa: E402
from lab.models import publish_lab_models  # noqa: E402
from lab.prefect_local import PROJECT_ROOT, PrefectServer, free_port  # noqa: E402

RECIPE = PROJECT_ROOT / "recipes" / "lab-dsv41-3x" / "recipe.toml"


def sized_recipe(directory: Path, nodes: int) -> str:
    text = RECIPE.read_text()
    for key in ("required_nodes", "tensor_parallel_size"):
        text = text.replace(f"{key} = 3", f"{key} = {nodes}", 1)
    text = text.replace('"draft_tensor_parallel_size":3', f'"draft_tensor_parallel_size":{nodes}')
    path = directory / f"bench-dsv41-{nodes}x" / "recipe.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path.parent)


def measure(nodes: int, rounds: int, workdir: Path) -> list[float]:
    from flows.deploy import deploy
    from flows.teardown import teardown

    lab = Lab(f"bench{nodes}", nodes)
    lab.up()
    try:
        build_engine_image(lab)
        publish_lab_models(lab.hub_repos_dir)
        cluster = str(lab.inventory_path)
        recipe = sized_recipe(workdir, nodes)
        deploy(recipe, cluster=cluster)  # cold: prefetch, staging, pulls
        teardown(recipe, cluster=cluster)
        overheads = []
        for round_number in range(1, rounds + 1):
            with measured() as usage:
                summary = deploy(recipe, cluster=cluster)
            wall = usage.wall_s
            engine = summary.ready_after_s or 0.0
            overheads.append(wall - engine)
            steps = ", ".join(f"{k} {v:.1f}" for k, v in summary.step_seconds.items())
            print(
                f"  {nodes} nodes, warm round {round_number}: wall {wall:.2f} s, engine ready"
                f" {engine:.2f} s, overhead {wall - engine:.2f} s ({steps});"
                f" CPU {usage.busy_s:.2f} s, {usage.cores_busy:.2f} of {os.cpu_count()} cores"
                f" busy ({usage.top(5)})",
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
    options = parser.parse_args()
    sizes = [int(size) for size in options.nodes.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-redeploy-") as scratch:
        workdir = Path(scratch)
        server = PrefectServer(workdir / "prefect", port=free_port())
        server.start()
        os.environ.update({k: v for k, v in server.env().items() if k.startswith("PREFECT_")})
        try:
            medians = {
                size: statistics.median(measure(size, options.rounds, workdir)) for size in sizes
            }
        finally:
            server.stop()
    for size, overhead in medians.items():
        print(f"warm redeploy overhead, {size} nodes: {overhead:.2f} s (median)")
    if len(sizes) > 1:
        smallest, largest = min(sizes), max(sizes)
        print(
            f"overhead ratio {largest}/{smallest} nodes: "
            f"{medians[largest] / medians[smallest]:.2f} (target <= 1.3)"
        )
    print("target: overhead <= 5 s on 3 nodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
