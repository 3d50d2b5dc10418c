"""The memory checks on the lab, through the deploy flow: a recipe too large for the lab
inventory's declared node memory is refused before any node is touched; a node with less free
memory than the recipe wants at start is refused by the preflight, naming the figures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from lab_flows import nothing_runs

from flows.deploy import deploy
from lab.cluster import Lab
from lab.inventory import LAB_NODE_MEMORY_GIB
from lab.models import publish_lab_models
from lab.tinymodel import generate_repo
from sparkdeploy.errors import ContainerStartError, DoesNotFit
from sparkdeploy.remote.ssh import cached_connection, close_cached
from sparkdeploy.remote.targets import node_target
from sparkdeploy.spec.project import load_plan

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]

LONG_CONTEXT = Path(__file__).parent / "fixtures" / "lab-long-context"


@pytest.fixture(scope="module")
def cluster(lab_cluster: Lab, lab_engine_image: str) -> Iterator[str]:
    """The lab's inventory (a path), with the lab models and the 4M-context one in its hub."""
    publish_lab_models(lab_cluster.hub_repos_dir)
    generate_repo(
        lab_cluster.hub_repos_dir, "lab/tiny-chat-4m", total_bytes=1 << 20, context_length=4 << 20
    )
    yield str(lab_cluster.inventory_path)
    close_cached()


def test_a_recipe_too_large_for_the_nodes_is_refused_before_any_node_is_touched(
    cluster: str,
) -> None:
    plan = load_plan(str(LONG_CONTEXT), cluster)
    with pytest.raises(DoesNotFit) as refused:
        deploy(str(LONG_CONTEXT), cluster=cluster)
    message = str(refused.value)
    for expected in (
        f"recipe lab-long-context does not fit the memory of cluster {plan.cluster}",
        "node node1: weights 1.0 MiB + engine overhead 2.0 GiB + KV cache 16.0 GiB",
        f"x the inventory's memory_gib {LAB_NODE_MEMORY_GIB:g} GiB",
        "one request of 4,194,304 tokens needs 16.0 GiB",
        "--max-model-len",
        "--kv-cache-dtype fp8",
    ):
        assert expected in message, message
    # Nothing happened on the node: no container, the node not held, nothing composed.
    nothing_runs(cluster)
    [node] = plan.nodes
    assert node.composed is not None
    listed = cached_connection(node_target(node)).run(
        ["ls", "-d", node.composed.root], timeout=30, check=False
    )
    assert listed.exit_code != 0, f"{node.node} has {node.composed.root}"


def test_a_node_short_of_the_free_memory_the_recipe_wants_is_refused_at_preflight(
    cluster: str, lab_cluster: Lab
) -> None:
    """The lab's nodes share the host's /proc/meminfo: an inventory declaring nodes of 1000 GiB
    passes the fit check and asks vLLM's start-up share of that, which no lab node has free."""
    declared = f"memory_gib = {LAB_NODE_MEMORY_GIB!r}"
    text = Path(cluster).read_text()
    assert declared in text
    big = lab_cluster.inventory_path.with_name("cluster-1000g.toml")
    big.write_text(text.replace(declared, "memory_gib = 1000.0"))
    try:
        with pytest.raises(ContainerStartError) as refused:
            deploy("lab-single", cluster=str(big), skip=["smoke-test"])
        message = str(refused.value)
        assert "node node1: " in message
        assert "GiB free (MemAvailable) of " in message
        assert (
            "but the recipe needs 920.0 GiB free at start (--gpu-memory-utilization 0.92 x 1000"
            " GiB, the inventory's memory_gib; vLLM would refuse to start)" in message
        )
        nothing_runs(str(big))
    finally:
        big.unlink()
