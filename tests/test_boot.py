"""Boot: RoCE detection from a sysfs tree and preflight judgement (unit); a 3-node mp boot, with
teardown, on the lab."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from lab.cluster import Lab
from sparkdeploy.errors import ContainerStartError
from sparkdeploy.node.probe import detect_roce, ipv4_of_gid
from sparkdeploy.remote.ssh import cached_connection
from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import Plan, make_plan
from sparkdeploy.spec.recipe import Recipe
from sparkdeploy.steps.boot import _judge, _node_problems, boot
from sparkdeploy.steps.teardown import teardown

GIB = 1024**3


def _port(root: Path, hca: str, state: str, gids: dict[int, tuple[str, str]]) -> None:
    port = root / hca / "ports" / "1"
    (port / "gids").mkdir(parents=True)
    (port / "gid_attrs" / "types").mkdir(parents=True)
    (port / "state").write_text(f"{state}\n")
    (port / "link_layer").write_text("Ethernet\n")
    for index, (gid, kind) in gids.items():
        (port / "gids" / str(index)).write_text(gid + "\n")
        (port / "gid_attrs" / "types" / str(index)).write_text(kind + "\n")


def test_roce_detection_picks_active_hcas_and_the_v2_ipv4_gid_of_the_fabric_ip(
    tmp_path: Path,
) -> None:
    link_local = "fe80:0000:0000:0000:0ac0:ebff:fe12:3456"
    fabric = "0000:0000:0000:0000:0000:ffff:0a4d:000b"  # 10.77.0.11
    other = "0000:0000:0000:0000:0000:ffff:c0a8:0101"  # 192.168.1.1
    _port(
        tmp_path,
        "rocep1s0f1",
        "4: ACTIVE",
        {
            0: (link_local, "IB/RoCE v1"),
            1: (link_local, "RoCE v2"),
            2: (fabric, "IB/RoCE v1"),
            3: (fabric, "RoCE v2"),
        },
    )
    _port(tmp_path, "roceP2p1s0f1", "4: ACTIVE", {3: (other, "RoCE v2")})
    _port(tmp_path, "rocep1s0f0", "1: DOWN", {3: (other, "RoCE v2")})
    found = detect_roce(str(tmp_path), "10.77.0.11")
    assert found["hcas"] == ["roceP2p1s0f1", "rocep1s0f1"]
    assert found["gid_index"] == 3
    assert any("rocep1s0f0" in note for note in found["notes"])
    assert ipv4_of_gid(fabric) == "10.77.0.11"
    assert ipv4_of_gid(link_local) is None


def test_roce_detection_without_devices_leaves_everything_unset(tmp_path: Path) -> None:
    found = detect_roce(str(tmp_path / "absent"), "10.0.0.1")
    assert found == {
        "devices": False,
        "hcas": [],
        "gid_index": None,
        "notes": [found["notes"][0]],
    }
    assert "no RDMA devices" in found["notes"][0]


def _lab_plan(lab: Lab, image: str, env: dict[str, str] | None = None) -> Plan:
    recipe = Recipe(
        name="boot test",
        docker_image=image,
        model="lab/tiny-chat",
        required_nodes=3,
        tensor_parallel_size=3,
        entrypoint=["vllm", "serve"],
        args=["--served-model-name", "boot-test", "--max-model-len", "4096"],
        env={"HF_HUB_OFFLINE": "1", **(env or {})},
    )
    # The lab inventory's [docker] ulimits leave out memlock, which its sandbox cannot raise.
    return make_plan(recipe, load_cluster(lab.inventory_path))


def _example_plan() -> Plan:
    recipe = Recipe(
        name="t",
        docker_image="img:1",
        model="org/m",
        required_nodes=1,
        args=["--gpu-memory-utilization", "0.9"],
    )
    inventory = Path(__file__).parent.parent / "clusters" / "dgx-spark-4.toml"
    return make_plan(recipe, load_cluster(inventory))


def _answer(**changes: Any) -> dict[str, Any]:
    """A preflight answer of a healthy GB10 (121.63 GiB unified), with changes."""
    answer: dict[str, Any] = {
        "docker": {"version": "28"},
        "image": {"id": "sha256:1"},
        "missing_paths": [],
        "gpus": 1,
        "memory": {
            "total": 119 * GIB,
            "free": 115 * GIB,
            "available": 116 * GIB,
            "page_cache": 1 * GIB,
        },
        "page_cache_dropped": False,
        "gpu_processes": {"checked": True, "processes": []},
    }
    return {**answer, **changes}


def test_preflight_problems_name_the_fix() -> None:
    plan = _example_plan()
    answer = _answer(
        image=None,
        missing_paths=["/srv/nas/hf-cache"],
        gpus=0,
        page_cache_dropped=False,
        page_cache_error="Permission denied",
        memory={"total": 119 * GIB, "free": 1 * GIB, "available": 2 * GIB, "page_cache": 0},
    )
    problems = _node_problems(plan, plan.nodes[0], answer)
    assert len(problems) == 5
    text = "\n".join(problems)
    for expected in ("image img:1", "/srv/nas/hf-cache", "no GPU", "drop_caches", "1.0 GiB free"):
        assert expected in text
    down = _node_problems(plan, plan.nodes[0], {"docker": {"error": "Cannot connect"}})
    assert down == ["docker does not answer (Cannot connect): start dockerd there"]


def test_free_memory_below_what_vllm_wants_at_start_is_refused_naming_the_figures() -> None:
    plan = _example_plan()
    node = plan.nodes[0]
    assert _node_problems(plan, node, _answer()) == []
    # 0.9 x 121.63 GiB = 109.5 GiB; on unified memory the page cache counts as used.
    cached = _answer(
        memory={
            "total": 119 * GIB,
            "free": 100 * GIB,
            "available": 117 * GIB,
            "page_cache": 17 * GIB,
        }
    )
    [problem] = _node_problems(plan, node, cached)
    assert problem.startswith(
        "100.0 GiB free (MemFree: the GPU counts the page cache as used) of 119.0 GiB, but the"
        " recipe needs 109.5 GiB free at start (--gpu-memory-utilization 0.9 x 121.63 GiB"
    )
    assert "page cache holds 17.0 GiB: set [docker] drop_page_cache = true" in problem
    dropped = {**cached, "page_cache_dropped": True}
    [problem] = _node_problems(plan, node, dropped)
    assert "the page cache was dropped and it is still short" in problem


def test_preflight_reports_free_memory_the_page_cache_and_a_skipped_gpu_check() -> None:
    plan = _example_plan()
    before = {"total": 119 * GIB, "free": 100 * GIB, "available": 117 * GIB, "page_cache": 17 * GIB}
    after = {**before, "free": 116 * GIB, "page_cache": 1 * GIB}
    answer = _answer(
        memory=after,
        memory_before_drop=before,
        page_cache_dropped=True,
        gpu_processes={"checked": False, "reason": "nvidia-smi is not installed on this node"},
    )
    logged: list[str] = []
    [check] = _judge(plan, {"dgx1": answer}, log=logged.append).values()
    assert check.free_before_drop_bytes == 100 * GIB
    assert (
        "116.0 GiB free of the 109.5 GiB needed, page cache 1.0 GiB (dropped: 100.0 GiB"
        in (logged[0])
    )
    assert logged[1:] == [
        "node dgx1: GPU processes not checked: nvidia-smi is not installed on this node"
    ]


def test_a_gpu_process_left_by_an_earlier_run_is_refused() -> None:
    plan = _example_plan()
    processes = [
        {"pid": 4242, "name": "VLLM::EngineCore", "used_bytes": 6265 << 20},
        {"pid": 77, "name": "python3", "used_bytes": None},
    ]
    answer = _answer(gpu_processes={"checked": True, "processes": processes})
    assert _node_problems(plan, plan.nodes[0], answer) == [
        "GPU process 4242 (VLLM::EngineCore) holds 6.1 GiB memory: an engine of an earlier run"
        " still running? stop it (its container, or `kill 4242` on the node) before deploying",
        "GPU process 77 (python3) holds GPU memory: an engine of an earlier run still running?"
        " stop it (its container, or `kill 77` on the node) before deploying",
    ]


def _inspect(lab: Lab, node: str, container: str) -> dict[str, Any]:
    result = cached_connection(lab.ssh_target(node)).run(
        ["docker", "inspect", container], timeout=60
    )
    inspected: dict[str, Any] = json.loads(result.stdout)[0]
    return inspected


def _wait_for_log(lab: Lab, node: str, container: str, timeout_s: float = 60) -> None:
    """Until the container has printed something (a boot returns before the engine logs)."""
    deadline = time.monotonic() + timeout_s
    connection = cached_connection(lab.ssh_target(node))
    while True:
        logged = connection.run(["docker", "logs", container], timeout=60)
        if logged.stdout.strip() or logged.stderr.strip():
            return
        assert time.monotonic() < deadline, f"{container} printed nothing in {timeout_s} s"
        time.sleep(0.2)


@pytest.mark.lab
def test_boot_then_teardown_removes_exactly_ours(lab_cluster: Lab, lab_engine_image: str) -> None:
    plan = _lab_plan(lab_cluster, lab_engine_image)
    from sparkdeploy.steps.image import ensure_image

    ensure_image(plan_targets(plan), lab_engine_image)
    foreign = cached_connection(lab_cluster.ssh_target("node2"))
    foreign.run(["docker", "rm", "--force", "not-ours"], timeout=60, check=False)
    foreign.run(
        [
            "docker",
            "run",
            "-d",
            "--name",
            "not-ours",
            "--label",
            "owner=someone-else",
            "--network",
            "host",
            "--entrypoint",
            "sleep",
            lab_engine_image,
            "300",
        ],
        timeout=60,
    )
    try:
        result = boot(plan)
        assert [booted.node for booted in result.nodes] == ["node1", "node2", "node3"]
        for node_plan in plan.nodes:
            inspected = _inspect(lab_cluster, node_plan.node, node_plan.container.name)
            assert inspected["Id"] == result.container_ids[node_plan.node]
            labels = inspected["Config"]["Labels"]
            assert labels["sparkdeploy.deployment"] == plan.deployment_id
            assert labels["sparkdeploy.node"] == node_plan.node
            assert labels["sparkdeploy.rank"] == str(node_plan.rank)
            entrypoint = node_plan.container.entrypoint
            assert inspected["Config"]["Entrypoint"] == entrypoint[:1]
            assert inspected["Config"]["Cmd"] == [*entrypoint[1:], *node_plan.container.command]
            env = dict(item.split("=", 1) for item in inspected["Config"]["Env"])
            assert env["VLLM_HOST_IP"] == node_plan.fabric_ip
            assert "NCCL_IB_GID_INDEX" not in env  # no RDMA in the lab
            assert ("--headless" in inspected["Config"]["Cmd"]) == (node_plan.rank > 0)

        # A second boot replaces our containers (stale), keeping their logs.
        again = boot(plan)
        assert {c.node for c in again.stale_removed} == {"node1", "node2", "node3"}
        assert again.container_ids != result.container_ids

        _wait_for_log(lab_cluster, "node1", plan.nodes[0].container.name)
        report = teardown(plan.deployment_id, lab_cluster.ssh_targets(), plan.runs_dir)
        assert sorted(c.node for c in report.removed) == ["node1", "node2", "node3"]
        for container in report.removed:
            saved = Path(container.log_path)
            assert saved == Path(plan.runs_dir) / plan.deployment_id / f"{container.node}.log"
            assert saved.read_text().splitlines()[-len(container.excerpt) :] == container.excerpt
        head_log = Path(plan.runs_dir, plan.deployment_id, "node1.log").read_text()
        assert head_log.strip(), "the head's log was saved empty"
        assert Path(plan.runs_dir, plan.deployment_id, "node1.1.log").exists()
        assert _inspect(lab_cluster, "node2", "not-ours")["State"]["Running"]

        assert teardown(plan.deployment_id, lab_cluster.ssh_targets(), plan.runs_dir).removed == []
    finally:
        foreign.run(["docker", "rm", "--force", "not-ours"], timeout=60, check=False)
        teardown(plan.deployment_id, lab_cluster.ssh_targets(), plan.runs_dir)


@pytest.mark.lab
def test_preflight_refuses_a_missing_image_before_starting_anything(
    lab_cluster: Lab,
) -> None:
    plan = _lab_plan(lab_cluster, "lab/never-pulled:1")
    with pytest.raises(ContainerStartError) as caught:
        boot(plan)
    message = str(caught.value)
    for node in lab_cluster.nodes:
        assert f"node {node}: image lab/never-pulled:1 is not there" in message
    assert teardown(plan.deployment_id, lab_cluster.ssh_targets(), plan.runs_dir).removed == []
