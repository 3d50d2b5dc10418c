"""The lab cluster, over real SSH from Python: each node is its own machine as far as the
pipeline can see (own docker, /tmp, hostname, fabric netdev), with a shared NAS and a registry
that every node pulls from, and the engine image boots across the nodes."""

from __future__ import annotations

import io
import json
import os
import secrets
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import TEST_LAB_NAME
from lab_flows import lab_unavailable_reason

from lab.cluster import Lab
from lab.layout import FABRIC_NETDEV
from lab.network import existing_netns
from lab.testing.hfcache_layout import cache_repo
from lab.tinymodel import generate_repo
from sparkdeploy.remote.ssh import Connection, cached_connection, connect, on_all
from sparkdeploy.spec.cluster import load_cluster

pytestmark = pytest.mark.lab

COMMAND_S = 60.0
BOOT_S = 90.0


def run(lab: Lab, node: str, *argv: str, stdin: bytes | None = None) -> str:
    result = cached_connection(lab.ssh_target(node)).run(argv, timeout=COMMAND_S, stdin=stdin)
    return result.stdout.decode()


def _running_in(netns_inodes: set[int], cgroup_marker: str) -> list[str]:
    """Processes with a thread still running whose netns or cgroup is one of the lab's. A
    process fully exited but not yet reaped (re-parented to an init that reaps when it likes)
    has no namespaces left and is not one."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            inode = (entry / "ns" / "net").stat().st_ino
            cgroups = (entry / "cgroup").read_text()
            states = [
                (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                for task in (entry / "task").iterdir()
            ]
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(state not in ("Z", "X") for state in states) and (
            inode in netns_inodes or cgroup_marker in cgroups
        ):
            found.append(f"{entry.name} {command}")
    return found


def test_down_returns_once_every_process_of_the_lab_has_exited() -> None:
    reason = lab_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    lab = Lab(f"{TEST_LAB_NAME}-down", 2)
    lab.up()
    try:
        # A process in the node's netns outside the node's process tree (its session is over).
        with connect(lab.ssh_target(lab.nodes[0])) as connection:
            connection.run(
                ["sh", "-c", "sleep 300 </dev/null >/dev/null 2>&1 &"], timeout=COMMAND_S
            )
        netns_inodes = {
            os.stat(f"/run/netns/{name}").st_ino for name in existing_netns(lab.layout.netns_prefix)
        }
    finally:
        lab.down()
    assert _running_in(netns_inodes, lab.layout.cgroup_prefix) == []
    assert lab.remains() == []


def test_a_lab_in_use_is_not_brought_up_again_under_its_owner(lab_cluster: Lab) -> None:
    """Two sessions with one lab name: the second's `up` would remove the first's lab as the
    remains of a crashed one; it is refused instead, naming the owner, and the lab lives on."""
    second = subprocess.run(
        [sys.executable, "-c", f"from lab.cluster import Lab; Lab({lab_cluster.name!r}, 3).up()"],
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert second.returncode != 0
    assert f"is up and in use by process {os.getpid()}" in second.stderr
    assert "SPARKDEPLOY_TEST_LAB" in second.stderr
    assert run(lab_cluster, lab_cluster.nodes[0], "hostname").strip() == lab_cluster.nodes[0]


def test_inventory_loads_and_names_every_node(lab_cluster: Lab) -> None:
    cluster = load_cluster(lab_cluster.inventory_path)
    assert [node.name for node in cluster.nodes] == lab_cluster.nodes
    addresses = [lab_cluster.node_ip(node) for node in lab_cluster.nodes]
    assert [node.host for node in cluster.nodes] == addresses
    assert cluster.docker.registry == lab_cluster.registry
    assert cluster.docker.gpus == ""
    assert Path(cluster.nas.hf_cache).is_dir()


def test_each_node_is_its_own_host_on_the_fabric(lab_cluster: Lab) -> None:
    source = (
        "import json, os, socket, subprocess\n"
        "address = subprocess.run(['ip', '-o', '-4', 'addr', 'show', 'dev', os.sys.argv[1]],\n"
        "                         capture_output=True, text=True, check=True).stdout.split()[3]\n"
        "print(json.dumps({'hostname': socket.gethostname(), 'address': address,\n"
        "                  'netdevs': sorted(os.listdir('/sys/class/net'))}))\n"
    )
    seen = on_all(
        lab_cluster.ssh_targets(),
        lambda c: json.loads(c.run_python(source, [FABRIC_NETDEV], timeout=COMMAND_S).stdout),
    )
    for node, facts in seen.items():
        assert facts == {
            "hostname": node,
            "address": f"{lab_cluster.node_ip(node)}/24",
            "netdevs": sorted([FABRIC_NETDEV, "lo"]),
        }


def test_nodes_reach_each_other_over_the_fabric(lab_cluster: Lab) -> None:
    first, *others = lab_cluster.nodes
    source = (
        "import socket, sys\n"
        "with socket.create_connection((sys.argv[1], 22), timeout=5) as peer:\n"
        "    print(peer.recv(8).decode())\n"
    )
    for node in others:
        connection = cached_connection(lab_cluster.ssh_target(node))
        banner = connection.run_python(source, [lab_cluster.node_ip(first)], timeout=COMMAND_S)
        assert banner.stdout.startswith(b"SSH-")


def test_each_node_has_its_own_dockerd(lab_cluster: Lab, lab_engine_image: str) -> None:
    ids = on_all(
        lab_cluster.ssh_targets(),
        lambda c: c.run(["docker", "info", "--format", "{{.ID}}"], timeout=COMMAND_S).stdout,
    )
    assert len(set(ids.values())) == len(lab_cluster.nodes)

    first, *others = lab_cluster.nodes
    name = f"probe-{secrets.token_hex(4)}"
    run(lab_cluster, first, "docker", "create", "--name", name, lab_engine_image, "true")
    try:
        listing = ["docker", "ps", "--all", "--filter", f"name={name}", "--format", "{{.Names}}"]
        assert run(lab_cluster, first, *listing).split() == [name]
        for node in others:
            assert run(lab_cluster, node, *listing).split() == []
    finally:
        run(lab_cluster, first, "docker", "rm", "--force", name)


def test_tmp_is_private_and_the_nas_shared(lab_cluster: Lab) -> None:
    first, second, third = lab_cluster.nodes[:3]
    token = secrets.token_hex(8)
    run(lab_cluster, first, "sh", "-c", 'echo "$1" > "/tmp/$1"', "sh", token)
    assert run(lab_cluster, first, "cat", f"/tmp/{token}").strip() == token
    for node in (second, third):
        result = cached_connection(lab_cluster.ssh_target(node)).run(
            ["cat", f"/tmp/{token}"], timeout=COMMAND_S, check=False
        )
        assert result.exit_code != 0
    assert not Path("/tmp", token).exists()

    shared = lab_cluster.nas_dir / f"probe-{token}"
    try:
        run(lab_cluster, second, "sh", "-c", 'echo "$1" > "$2"', "sh", token, str(shared))
        assert run(lab_cluster, third, "cat", str(shared)).strip() == token
        assert shared.read_text().strip() == token
    finally:
        shared.unlink(missing_ok=True)


def test_hardlinks_between_var_tmp_and_tmp_work_on_every_node(lab_cluster: Lab) -> None:
    source = (
        "import os, sys\n"
        "tmp, var_tmp = f'/tmp/{sys.argv[1]}', f'/var/tmp/{sys.argv[1]}-link'\n"
        "open(tmp, 'w').close()\n"
        "os.link(tmp, var_tmp)\n"
        "print(os.stat(var_tmp).st_ino == os.stat(tmp).st_ino, os.stat(tmp).st_nlink)\n"
        "os.unlink(tmp); os.unlink(var_tmp)\n"
    )
    token = secrets.token_hex(6)
    outputs = on_all(
        lab_cluster.ssh_targets(),
        lambda c: c.run_python(source, [token], timeout=COMMAND_S).stdout.split(),
    )
    assert outputs == {node: [b"True", b"2"] for node in lab_cluster.nodes}


def _single_file_image(content: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        member = tarfile.TarInfo("probe.txt")
        member.size = len(content)
        tar.addfile(member, io.BytesIO(content))
    return buffer.getvalue()


def test_an_image_pushed_to_the_registry_is_pulled_by_every_node(lab_cluster: Lab) -> None:
    first, *others = lab_cluster.nodes
    token = secrets.token_hex(6)
    pushed = f"{lab_cluster.registry}/lab/probe:{token}"
    run(lab_cluster, first, "docker", "import", "-", pushed, stdin=_single_file_image(b"x"))
    run(lab_cluster, first, "docker", "push", pushed)
    image_id = run(lab_cluster, first, "docker", "image", "inspect", "-f", "{{.Id}}", pushed)
    for node in others:
        # The docker.io-style name: the node's dockerd gets it through its registry mirror.
        run(lab_cluster, node, "docker", "pull", f"lab/probe:{token}")
        inspect = ["docker", "image", "inspect", "-f", "{{.Id}}", f"lab/probe:{token}"]
        assert run(lab_cluster, node, *inspect) == image_id


def test_engine_image_is_rebuilt_only_when_its_inputs_change(
    lab_cluster: Lab, lab_engine_image: str
) -> None:
    from lab.image import ImageInputs, build_engine_image

    def latest_digest() -> str:
        request = urllib.request.Request(
            f"http://{lab_cluster.registry}/v2/lab/vllm-standin/manifests/latest",
            method="HEAD",
            headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            return str(reply.headers["Docker-Content-Digest"])

    assert build_engine_image(lab_cluster) == lab_engine_image == "lab/vllm-standin:latest"
    digest = latest_digest()
    fingerprint = ImageInputs.find().fingerprint()
    assert build_engine_image(lab_cluster) == lab_engine_image
    assert latest_digest() == digest
    tags_url = f"http://{lab_cluster.registry}/v2/lab/vllm-standin/tags/list"
    with urllib.request.urlopen(tags_url, timeout=10) as reply:
        assert fingerprint in json.load(reply)["tags"]


# -- the engine image boots across the nodes ---------------------------------------------


@pytest.fixture
def standin_containers(lab_cluster: Lab) -> Iterator[dict[str, str]]:
    """Container name per node; every one of them is removed afterwards."""
    names = {node: f"standin-{secrets.token_hex(4)}" for node in lab_cluster.nodes}
    yield names

    node_of = {lab_cluster.ssh_target(node): node for node in names}

    def remove(connection: Connection) -> None:
        container = names[node_of[connection.target]]
        connection.run(["docker", "rm", "--force", container], timeout=COMMAND_S, check=False)

    on_all(lab_cluster.ssh_targets(), remove)


def container_log(lab: Lab, node: str, container: str) -> str:
    """stdout and stderr of the container (docker logs replays each on its own stream)."""
    result = cached_connection(lab.ssh_target(node)).run(
        ["docker", "logs", container], timeout=COMMAND_S
    )
    return (result.stdout + result.stderr).decode(errors="replace")


def _http_json(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.load(reply)


def _wait_healthy(url: str, lab: Lab, node: str, container: str) -> None:
    deadline = time.monotonic() + BOOT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    raise AssertionError(
        f"head not healthy; its log:\n{run(lab, node, 'docker', 'logs', container)}"
    )


def test_engine_image_boots_on_three_nodes_and_answers_a_chat(
    lab_cluster: Lab, lab_engine_image: str, standin_containers: dict[str, str]
) -> None:
    hf_cache = lab_cluster.nas_dir / "hf-cache"
    model = "lab/tiny-boot"
    repo = generate_repo(lab_cluster.nas_dir / "repos", model)
    cache_repo(repo, hf_cache)
    head = lab_cluster.nodes[0]
    head_ip, api_port, master_port = lab_cluster.node_ip(head), 8000, 29501
    nnodes = len(lab_cluster.nodes)

    node_of = {lab_cluster.ssh_target(node): node for node in lab_cluster.nodes}

    def start(connection: Connection) -> None:
        node = node_of[connection.target]
        rank = lab_cluster.nodes.index(node)
        argv = [
            *("docker", "run", "--detach", "--name", standin_containers[node], "--network=host"),
            *("--volume", f"{hf_cache}:{hf_cache}:ro"),
            *("--env", "HF_HUB_OFFLINE=1", "--env", f"HF_HUB_CACHE={hf_cache}"),
            *("--env", f"VLLM_HOST_IP={lab_cluster.node_ip(node)}"),
            *("--env", f"NCCL_SOCKET_IFNAME={FABRIC_NETDEV}", "--env", "STANDIN_DECODE_DELAY_S=0"),
            lab_engine_image,
            *("vllm", "serve", model, "--served-model-name", "tiny"),
            *("--tensor-parallel-size", str(nnodes), "--distributed-executor-backend", "mp"),
            *("--nnodes", str(nnodes), "--node-rank", str(rank)),
            *("--master-addr", head_ip, "--master-port", str(master_port)),
            *(["--headless"] if rank else ["--host", head_ip, "--port", str(api_port)]),
        ]
        connection.run(argv, timeout=COMMAND_S)

    on_all(lab_cluster.ssh_targets(), start)
    url = f"http://{head_ip}:{api_port}"
    _wait_healthy(url, lab_cluster, head, standin_containers[head])

    assert [entry["id"] for entry in _http_json(f"{url}/v1/models")["data"]] == ["tiny"]
    reply = _http_json(
        f"{url}/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "What is 127*43? Answer with the number."}],
            "temperature": 0,
        },
    )
    assert "5461" in reply["choices"][0]["message"]["content"]
    head_log = container_log(lab_cluster, head, standin_containers[head])
    assert head_log.count("joined the process group") == nnodes - 1
    for rank, node in enumerate(lab_cluster.nodes[1:], start=1):
        log = container_log(lab_cluster, node, standin_containers[node])
        assert f"(Worker_TP{rank} " in log
        assert "headless" in log
