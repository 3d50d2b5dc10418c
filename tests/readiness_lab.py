"""Engine stand-in deployments on the lab for the readiness and gate/smoke task tests.

A deployment is the plan of a small mp recipe (lab/tiny-chat, read from the NAS HF cache) on the
lab's nodes; its containers are started here with the plan's own `docker run` argv (the boot
step's job in the pipeline) and removed by `remove()`, however the test ended.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lab.cluster import Lab
from lab.testing.hfcache_layout import cache_repo
from lab.tinymodel import generate_repo
from sparkdeploy.remote.ssh import Connection, SshTarget, on_all
from sparkdeploy.remote.targets import node_target
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import NodePlan, Plan, make_plan
from sparkdeploy.spec.recipe_loading import load_recipe

MODEL = "lab/tiny-chat"
SERVED = "tiny"
DOCKER_S = 60.0


def cache_tiny_model(lab: Lab) -> None:
    """lab/tiny-chat in the lab's NAS HF cache (where the plan mounts it from)."""
    hf_cache = Path(load_cluster(lab.inventory_path).nas.hf_cache)
    if not (hf_cache / ("models--" + MODEL.replace("/", "--"))).exists():
        cache_repo(generate_repo(lab.nas_dir / "repos", MODEL), hf_cache)


def lab_plan(
    lab: Lab,
    recipes_dir: Path,
    name: str,
    *,
    nodes: int,
    fault: str = "",
    args: tuple[str, ...] = (),
    smoke: str = "",
) -> Plan:
    """The plan of a tiny-chat recipe on the first `nodes` lab nodes, STANDIN_FAULT=`fault`."""
    recipe_dir = recipes_dir / name
    recipe_dir.mkdir(parents=True)
    (recipe_dir / "recipe.toml").write_text(
        f"""engine = "vllm"
name = "readiness test {name}"
docker_image = "lab/vllm-standin:latest"
model = "{MODEL}"
required_nodes = {nodes}
tensor_parallel_size = {nodes}
distributed_backend = "mp"
entrypoint = ["vllm", "serve"]
args = {json.dumps(["--served-model-name", SERVED, *args])}

[env]
HF_HUB_OFFLINE = "1"
STANDIN_FAULT = {json.dumps(fault)}
STANDIN_DECODE_DELAY_S = "0"
{smoke}
"""
    )
    return make_plan(load_recipe(recipe_dir / "recipe.toml"), load_cluster(lab.inventory_path))


@dataclass
class Deployment:
    plan: Plan

    def start(self) -> None:
        """Every container started at once (workers retry their rendezvous with the head)."""

        def start_container(connection: Connection) -> None:
            node = self._node_of(connection.target)
            connection.run(node.container.docker_run_argv(), timeout=DOCKER_S)

        on_all(self._targets(), start_container)

    def remove(self) -> None:
        def remove_container(connection: Connection) -> None:
            name = self._node_of(connection.target).container.name
            connection.run(["docker", "rm", "--force", name], timeout=DOCKER_S, check=False)

        on_all(self._targets(), remove_container)

    def remaining(self) -> list[str]:
        """Containers of this deployment still on the nodes, found by its label."""
        label = f"label=sparkdeploy.deployment={self.plan.deployment_id}"

        def listed(connection: Connection) -> list[str]:
            argv = ["docker", "ps", "--all", "--quiet", "--filter", label]
            return connection.run(argv, timeout=DOCKER_S).stdout.decode().split()

        found = on_all(self._targets(), listed)
        return [f"{node}:{container}" for node, ids in found.items() for container in ids]

    def _targets(self) -> dict[str, SshTarget]:
        return {node.node: node_target(node) for node in self.plan.nodes}

    def _node_of(self, target: SshTarget) -> NodePlan:
        return next(node for node in self.plan.nodes if node_target(node) == target)
