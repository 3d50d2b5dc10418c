from pathlib import Path

import pytest

from sparkdeploy.errors import InventoryError, PlanError
from sparkdeploy.spec.cluster import load_cluster

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "clusters" / "dgx-spark-4.toml"
BAD = Path(__file__).parent / "fixtures" / "bad" / "clusters"

# The inventory format (docs/inventory.md) as the lab writes it (paths relative to the file).
CONTRACT_INVENTORY = """\
name = "lab"
known_hosts = "known_hosts"

[ssh]
user = "root"
port = 22
identity_file = "id_ed25519"
connect_timeout_s = 10

[node_defaults]
gpus = 1
fabric_netdev = "enp1s0f1np1"
roce_hcas = "auto"
gid_index = "auto"

[[nodes]]
name = "node1"
host = "10.77.0.11"
fabric_ip = "10.77.0.11"

[[nodes]]
name = "node2"
host = "10.77.0.12"
fabric_ip = "10.77.0.12"
user = "ops"
port = 2222
roce_hcas = ["rocep1s0f1"]
gid_index = 3

[nas]
hf_cache = "/srv/nas/hf-cache"
runs_dir = "/srv/nas/runs"

[node_paths]
composed_root = "/var/tmp/sparkdeploy/composed"

[docker]
gpus = ""
run_options = []
registry = "10.77.0.2:5000"
drop_page_cache = false

[nccl.ds4]
NCCL_IB_DISABLE = "0"
"""


def write_contract_inventory(directory: Path) -> Path:
    path = directory / "lab.toml"
    path.write_text(CONTRACT_INVENTORY)
    return path


def test_contract_inventory_merges_defaults_and_resolves_paths(tmp_path: Path) -> None:
    cluster = load_cluster(write_contract_inventory(tmp_path))
    assert cluster.name == "lab"
    assert cluster.known_hosts == str(tmp_path / "known_hosts")
    first, second = cluster.nodes
    assert (first.user, first.port, first.roce_hcas, first.gid_index) == (
        "root",
        22,
        "auto",
        "auto",
    )
    assert (second.user, second.port, second.roce_hcas, second.gid_index) == (
        "ops",
        2222,
        ["rocep1s0f1"],
        3,
    )
    assert first.identity_file == second.identity_file == str(tmp_path / "id_ed25519")
    assert (first.home, second.home) == ("/root", "/home/ops")
    assert cluster.docker.gpus == ""
    assert cluster.nccl == {"ds4": {"NCCL_IB_DISABLE": "0"}}


def test_name_defaults_to_the_file_stem(tmp_path: Path) -> None:
    path = tmp_path / "rack7.toml"
    path.write_text(CONTRACT_INVENTORY.replace('name = "lab"\n', ""))
    assert load_cluster(path).name == "rack7"


def test_example_inventory() -> None:
    cluster = load_cluster(EXAMPLE)
    assert [node.name for node in cluster.nodes] == ["dgx1", "dgx2", "dgx3", "dgx4"]
    assert cluster.nodes[0].identity_file == str(Path("~/.ssh/id_ed25519").expanduser())
    assert [node.gid_index for node in cluster.nodes] == ["auto", "auto", "auto", 3]
    assert "ds4" in cluster.nccl


def test_missing_files_are_reported_and_present_ones_are_not(tmp_path: Path) -> None:
    cluster = load_cluster(write_contract_inventory(tmp_path))
    problems = cluster.missing_files()
    assert len(problems) == 2
    assert f"known_hosts {tmp_path / 'known_hosts'} does not exist" in problems[0]
    assert (
        f"identity_file {tmp_path / 'id_ed25519'} (nodes node1, node2) does not exist"
        in (problems[1])
    )
    (tmp_path / "known_hosts").write_text("")
    (tmp_path / "id_ed25519").write_text("")
    assert cluster.missing_files() == []


def test_selection_first_n_or_named_in_rank_order(tmp_path: Path) -> None:
    cluster = load_cluster(EXAMPLE)
    assert [node.name for node in cluster.select(2)] == ["dgx1", "dgx2"]
    assert [node.name for node in cluster.select(2, ["dgx4", "dgx2"])] == ["dgx4", "dgx2"]


@pytest.mark.parametrize(
    ("count", "names", "fragments"),
    [
        (5, None, ["the recipe needs 5 nodes, cluster dgx-spark-4 has 4", "add nodes"]),
        (2, ["dgx1", "dgx-2"], ["no node named 'dgx-2'", "did you mean 'dgx2'?"]),
        (2, ["dgx1", "dgx1"], ["node dgx1 selected twice", "name each node once"]),
        (2, ["dgx1"], ["1 nodes selected (dgx1) but the recipe needs required_nodes = 2"]),
    ],
)
def test_selection_errors(count: int, names: list[str] | None, fragments: list[str]) -> None:
    with pytest.raises(PlanError) as caught:
        load_cluster(EXAMPLE).select(count, names)
    for fragment in fragments:
        assert fragment in str(caught.value)


# Each malformed inventory: the fragments its error must contain (place, what is wrong, the fix).
BAD_INVENTORIES = {
    "duplicate-host": [":15: SSH host:port 10.77.0.11:22 is already used by nodes[0]", ":10)"],
    "duplicate-name": [":15: node name node1 is already used by nodes[0]", "needs its own"],
    "no-identity": [":9: node node1 has no identity_file: set it in [ssh] or on the node"],
    "no-netdev": [":14: node node2 has no fabric_netdev: set it in [node_defaults]"],
    "unknown-node-key": [":14: unknown key 'nodes[0].fabric_netdevice'", "'fabric_netdev'?"],
    "unknown-section": [":24: unknown key 'dokcer': did you mean 'docker'?"],
    "bad-hcas": [':9: node_defaults.roce_hcas: must be "auto" or a non-empty list'],
    "bad-gid": [":14: nodes[0].gid_index", "an integer ≥ 0, without quotes"],
    "missing-nas": ["missing-nas.toml: nas: required key is missing: add it"],
    "relative-nas": [":21: nas.hf_cache 'nas/hf-cache' must be an absolute path"],
    "profile-per-node-var": [":26: nccl.ds4.NCCL_SOCKET_IFNAME is set per node", "remove it"],
    "no-nodes": [":2: nodes: List should have at least 1 item", "add at least one"],
    "bad-node-name": [":11: nodes[0].name: 'dgx 1' is not a usable node name", "letters, digits"],
}


@pytest.mark.parametrize("name", sorted(BAD_INVENTORIES))
def test_malformed_inventory_message(name: str) -> None:
    path = BAD / f"{name}.toml"
    with pytest.raises(InventoryError) as caught:
        load_cluster(path)
    message = str(caught.value)
    assert message.startswith(str(path))
    for fragment in BAD_INVENTORIES[name]:
        assert fragment in message


def test_a_directory_for_known_hosts_or_a_key_is_named_as_one(tmp_path: Path) -> None:
    cluster = load_cluster(write_contract_inventory(tmp_path))
    (tmp_path / "known_hosts").mkdir()
    (tmp_path / "id_ed25519").mkdir()
    known_hosts, identity = cluster.missing_files()
    assert f"known_hosts {tmp_path / 'known_hosts'} is a directory: point known_hosts at" in (
        known_hosts
    )
    assert (
        f"identity_file {tmp_path / 'id_ed25519'} (nodes node1, node2) is a directory: point "
        "identity_file at the private key file" in identity
    )


# Each edit of the contract inventory: the fragments its error must contain.
EDITED_INVENTORIES: dict[str, tuple[list[tuple[str, str]], list[str]]] = {
    "empty-name": ([('name = "lab"', 'name = ""')], [":1: name: must not be empty"]),
    "empty-ssh-user": (
        [('user = "root"', 'user = ""')],
        [":5: ssh.user: must not be empty: write the SSH user's name, or remove the key"],
    ),
    "empty-node-user": ([('user = "ops"', 'user = ""')], [":25: nodes[1].user: must not be"]),
    "empty-host": (
        [('host = "10.77.0.12"', 'host = ""')],
        [":23: nodes[1].host: must not be empty: write the node's SSH address"],
    ),
    "empty-node-netdev": (
        [('user = "ops"', 'user = "ops"\nfabric_netdev = ""')],
        [":26: nodes[1].fabric_netdev: must not be empty", "remove the key on a node to use"],
    ),
    "empty-node-identity": (
        [('user = "ops"', 'user = "ops"\nidentity_file = " "')],
        [":26: nodes[1].identity_file: must not be empty: write the path of the SSH private key"],
    ),
    "name-ending-in-newline": (
        [('name = "node2"', 'name = "node2\\n"')],
        [":22: nodes[1].name: 'node2\\n' is not a usable node name"],
    ),
    "profile-variable-ending-in-newline": (
        [('NCCL_IB_DISABLE = "0"', '"NCCL_IB_DISABLE\\n" = "0"')],
        [":43: nccl.ds4: 'NCCL_IB_DISABLE\\n' is not an env variable name: letters, digits"],
    ),
    "fabric-ip-not-an-ip": (
        [('fabric_ip = "10.77.0.12"', 'fabric_ip = "not an ip; id"')],
        [":24: nodes[1].fabric_ip: 'not an ip; id' is not an IPv4 address", "like 192.168."],
    ),
    "hca-names-with-separators": (
        [('roce_hcas = ["rocep1s0f1"]', 'roce_hcas = ["a,b", "c d"]')],
        [":27: nodes[1].roce_hcas: 'a,b' is not an HCA name", "list each HCA as its own string"],
    ),
    "hosts-differing-in-case": (
        [
            ('host = "10.77.0.11"', 'host = "node.lan"'),
            ('host = "10.77.0.12"', 'host = "NODE.lan"'),
            ("port = 2222\n", ""),
        ],
        [":21: SSH host:port NODE.lan:22 is already used by nodes[0]", "as node.lan:22 (host"],
    ),
    "too-many-gpus": (
        [("gpus = 1", "gpus = 100000000")],
        [":11: node_defaults.gpus: 100000000 is more than 64 GPUs on one node: write the"],
    ),
    "too-much-memory": (
        [("gid_index = 3", "gid_index = 3\nmemory_gib = 1e9")],
        [":29: nodes[1].memory_gib: 1000000000.0 is more than 16384 GiB on one node"],
    ),
    "endless-connect-timeout": (
        [("connect_timeout_s = 10", "connect_timeout_s = inf")],
        [":8: ssh.connect_timeout_s: inf is more than 3600 seconds"],
    ),
}


@pytest.mark.parametrize("name", sorted(EDITED_INVENTORIES))
def test_edited_inventory_message(tmp_path: Path, name: str) -> None:
    edits, fragments = EDITED_INVENTORIES[name]
    text = CONTRACT_INVENTORY
    for old, new in edits:
        assert old in text
        text = text.replace(old, new, 1)
    path = tmp_path / "lab.toml"
    path.write_text(text)
    with pytest.raises(InventoryError) as caught:
        load_cluster(path)
    message = str(caught.value)
    assert message.startswith(str(path))
    for fragment in fragments:
        assert fragment in message
