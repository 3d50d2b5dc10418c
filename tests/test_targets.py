"""SSH targets of a plan's and an inventory's nodes (sparkdeploy.remote.targets): each node's own
SSH settings over the inventory's defaults, the cluster's known_hosts, files resolved on the flow
host; a plan's in rank order, an inventory's in its order. Nothing is connected to."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkdeploy.remote.ssh import SshTarget
from sparkdeploy.remote.targets import cluster_targets, node_target, plan_targets
from sparkdeploy.spec.cluster import Cluster, load_cluster
from sparkdeploy.spec.plan import Plan, make_plan
from sparkdeploy.spec.recipe_loading import load_recipe

ROOT = Path(__file__).parent.parent
PAIR = ROOT / "recipes" / "lab-pair" / "recipe.toml"
SINGLE = ROOT / "recipes" / "lab-single" / "recipe.toml"

INVENTORY = """\
name = "mixed"
known_hosts = "ssh/known_hosts"

[ssh]
user = "root"
port = 22
identity_file = "ssh/cluster_key"
connect_timeout_s = 10

[node_defaults]
fabric_netdev = "eth0"

[[nodes]]
name = "alpha"
host = "alpha.lan"
fabric_ip = "10.0.0.1"

[[nodes]]
name = "beta"
host = "10.1.0.2"
fabric_ip = "10.0.0.2"
user = "ubuntu"
port = 2222
identity_file = "/keys/beta"
connect_timeout_s = 3.5

[[nodes]]
name = "gamma"
host = "gamma.lan"
fabric_ip = "10.0.0.3"

[nas]
hf_cache = "/mnt/nas/hf-cache"
runs_dir = "/mnt/nas/runs"
"""


@pytest.fixture
def cluster(tmp_path: Path) -> Cluster:
    path = tmp_path / "inventory" / "mixed.toml"
    path.parent.mkdir()
    path.write_text(INVENTORY)
    return load_cluster(path)


def default_target(tmp_path: Path, host: str) -> SshTarget:
    return SshTarget(
        host=host,
        port=22,
        user="root",
        identity_file=str(tmp_path / "inventory" / "ssh" / "cluster_key"),
        known_hosts=str(tmp_path / "inventory" / "ssh" / "known_hosts"),
        connect_timeout_s=10.0,
    )


def beta_target(tmp_path: Path) -> SshTarget:
    return SshTarget(
        host="10.1.0.2",
        port=2222,
        user="ubuntu",
        identity_file="/keys/beta",
        known_hosts=str(tmp_path / "inventory" / "ssh" / "known_hosts"),
        connect_timeout_s=3.5,
    )


def test_an_inventorys_targets_are_all_its_nodes_in_inventory_order(
    cluster: Cluster, tmp_path: Path
) -> None:
    targets = cluster_targets(cluster)
    assert list(targets) == ["alpha", "beta", "gamma"]
    assert targets == {
        "alpha": default_target(tmp_path, "alpha.lan"),
        "beta": beta_target(tmp_path),
        "gamma": default_target(tmp_path, "gamma.lan"),
    }


def test_a_nodes_own_ssh_settings_win_over_the_inventory_defaults(cluster: Cluster) -> None:
    beta = cluster_targets(cluster)["beta"]
    assert (beta.user, beta.port, beta.identity_file, beta.connect_timeout_s) == (
        "ubuntu",
        2222,
        "/keys/beta",
        3.5,
    )
    assert str(beta) == "ubuntu@10.1.0.2:2222"


def test_relative_key_and_known_hosts_paths_are_resolved_beside_the_inventory(
    cluster: Cluster, tmp_path: Path
) -> None:
    alpha = cluster_targets(cluster)["alpha"]
    assert Path(alpha.identity_file) == tmp_path / "inventory" / "ssh" / "cluster_key"
    assert Path(alpha.known_hosts) == tmp_path / "inventory" / "ssh" / "known_hosts"
    assert Path(alpha.known_hosts).is_absolute()
    assert Path(alpha.identity_file).is_absolute()


def test_a_plans_targets_are_its_nodes_in_rank_order(cluster: Cluster, tmp_path: Path) -> None:
    plan = make_plan(load_recipe(PAIR), cluster, ["gamma", "beta"])
    targets = plan_targets(plan)
    assert list(targets) == ["gamma", "beta"]  # gamma is the head (rank 0)
    assert [node.node for node in plan.nodes if node.rank == 0] == ["gamma"]
    assert targets == {
        "gamma": default_target(tmp_path, "gamma.lan"),
        "beta": beta_target(tmp_path),
    }


def test_a_plan_reaches_its_nodes_as_the_inventory_does(cluster: Cluster) -> None:
    plan = make_plan(load_recipe(PAIR), cluster, ["beta", "alpha"])
    inventory = cluster_targets(cluster)
    assert plan_targets(plan) == {name: inventory[name] for name in ("beta", "alpha")}


def test_a_plan_without_named_nodes_takes_the_first_of_the_inventory(cluster: Cluster) -> None:
    plan: Plan = make_plan(load_recipe(SINGLE), cluster)
    assert list(plan_targets(plan)) == ["alpha"]


def test_a_node_target_is_the_plan_nodes_ssh_settings(cluster: Cluster, tmp_path: Path) -> None:
    plan = make_plan(load_recipe(PAIR), cluster, ["alpha", "beta"])
    head, worker = plan.nodes
    assert node_target(worker) == beta_target(tmp_path)
    assert node_target(head) == default_target(tmp_path, "alpha.lan")
    assert node_target(head) == plan_targets(plan)["alpha"]
