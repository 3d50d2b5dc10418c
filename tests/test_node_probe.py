"""sparkdeploy.node.probe and docker_facts: which docker it asks and how, and that both ways
answer alike."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.cluster import Lab
from sparkdeploy.node import probe as node_probe
from sparkdeploy.node.docker_facts import DEFAULT_DOCKER_SOCKET, EngineApi, docker_socket, quote
from sparkdeploy.node.probe import check_memory, gpu_processes, parse_compute_apps
from sparkdeploy.remote.node_probe import probe_script
from sparkdeploy.remote.node_script import last_json_line, python_argv
from sparkdeploy.remote.ssh import cached_connection
from sparkdeploy.spec.labels import DEPLOYMENT_LABEL


def test_the_socket_is_the_one_the_docker_cli_would_use(tmp_path: Path) -> None:
    home = str(tmp_path)
    assert docker_socket({}, home) == DEFAULT_DOCKER_SOCKET
    assert docker_socket({"DOCKER_HOST": "unix:///run/user/1000/docker.sock"}, home) == (
        "/run/user/1000/docker.sock"
    )
    assert docker_socket({"DOCKER_CONTEXT": "default"}, home) == DEFAULT_DOCKER_SOCKET


@pytest.mark.parametrize(
    "environ",
    [
        {"DOCKER_HOST": "tcp://10.0.0.5:2376"},
        {"DOCKER_HOST": "ssh://me@box"},
        {"DOCKER_CONTEXT": "far"},
    ],
)
def test_docker_configured_elsewhere_is_left_to_the_cli(
    environ: dict[str, str], tmp_path: Path
) -> None:
    assert docker_socket(environ, str(tmp_path)) is None


def test_the_current_context_of_the_cli_config_counts(tmp_path: Path) -> None:
    config = tmp_path / ".docker" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"currentContext": "remote-spark"}))
    assert docker_socket({}, str(tmp_path)) is None
    assert docker_socket({"DOCKER_CONFIG": str(tmp_path / "elsewhere")}, str(tmp_path)) == (
        DEFAULT_DOCKER_SOCKET
    )
    config.write_text("{not json")
    assert docker_socket({}, str(tmp_path)) == DEFAULT_DOCKER_SOCKET


def test_quote_keeps_what_a_reference_may_hold() -> None:
    assert quote("registry:5000/org/engine:1.2@sha256:ab", safe="/:@") == (
        "registry:5000/org/engine:1.2@sha256:ab"
    )
    assert quote('{"label": ["a=b"]}') == "%7B%22label%22%3A%20%5B%22a%3Db%22%5D%7D"
    assert quote("é") == "%C3%A9"


def test_an_absent_daemon_is_named_with_its_socket(tmp_path: Path) -> None:
    socket_path = str(tmp_path / "docker.sock")
    answer = EngineApi(socket_path).facts("engine:1", DEPLOYMENT_LABEL)
    assert answer["image"] is None
    assert answer["stale_containers"] == []
    error = answer["docker"]["error"]
    assert f"unix://{socket_path}" in error
    assert "Is the docker daemon running?" in error


@pytest.fixture
def answering_socket(tmp_path: Path) -> Iterator[tuple[str, list[bytes]]]:
    """A unix socket that answers every request with a 500 and records what it was asked."""
    path = str(tmp_path / "docker.sock")
    asked: list[bytes] = []
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()

    def serve() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            with connection:
                asked.append(connection.recv(65536))
                body = b'{"message": "layer store is corrupt"}'
                connection.sendall(
                    b"HTTP/1.0 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path, asked
    finally:
        server.close()
        thread.join(5)


def test_a_daemon_in_trouble_is_quoted(answering_socket: tuple[str, list[bytes]]) -> None:
    path, asked = answering_socket
    answer = EngineApi(path).facts("engine:1", DEPLOYMENT_LABEL)
    assert answer["docker"] == {
        "error": "docker answered GET /info with 500: layer store is corrupt"
    }
    assert asked[0].startswith(b"GET /info HTTP/1.0\r\n")


def _probe_on(lab: Lab, node: str, request: dict[str, object], *env: str) -> dict[str, object]:
    argv = python_argv(probe_script(), ["preflight", json.dumps(request)])
    result = cached_connection(lab.ssh_target(node)).run(["env", *env, *argv], timeout=60)
    answer = last_json_line(result.stdout)
    assert answer is not None, result.stderr
    return answer


@pytest.mark.lab
def test_engine_api_and_cli_answer_alike_on_a_node(lab_cluster: Lab, lab_engine_image: str) -> None:
    node = lab_cluster.nodes[0]
    connection = cached_connection(lab_cluster.ssh_target(node))
    label = "sparkdeploy.test-probe"
    connection.run(["docker", "rm", "--force", "probe-labelled"], timeout=60, check=False)
    connection.run(
        [
            "docker",
            "create",
            "--name",
            "probe-labelled",
            "--label",
            f"{label}=1",
            lab_engine_image,
            "true",
        ],
        timeout=60,
    )
    # A context that points at the node's own daemon: the probe must go through the CLI for it.
    connection.run(["docker", "context", "rm", "--force", "probe-cli"], timeout=60, check=False)
    connection.run(
        ["docker", "context", "create", "probe-cli", "--docker", "host=unix:///run/docker.sock"],
        timeout=60,
    )
    try:
        request: dict[str, object] = {
            "image": lab_engine_image,
            "paths": ["/", "/no/such/path", "/var/tmp/probe-made/cache"],
            "create": ["/var/tmp/probe-made/cache"],
            "gpus": False,
            "fabric_ip": None,
            "detect_rdma": False,
            "unified_memory": False,
            "required_free_bytes": 1 << 30,
            "drop_page_cache": False,
            "stale_label": label,
        }
        through_api = _probe_on(lab_cluster, node, request)
        through_cli = _probe_on(lab_cluster, node, request, "DOCKER_CONTEXT=probe-cli")
        for answer in (through_api, through_cli):
            # The writable mount's dir is made on the node; the others are only looked for.
            assert answer["missing_paths"] == ["/no/such/path"]
            assert answer["image"] is not None
            assert len(answer["stale_containers"]) == 1  # type: ignore[arg-type]
        for key in ("image", "stale_containers"):
            assert through_api[key] == through_cli[key]
        # The lab's nodes have no nvidia-smi: the GPU process check says so, and is skipped.
        assert through_api["gpu_processes"] == {
            "checked": False,
            "reason": "nvidia-smi is not installed on this node",
        }
        memory = through_api["memory"]
        assert isinstance(memory, dict)
        assert 0 < memory["free"] <= memory["total"]
        api_docker, cli_docker = through_api["docker"], through_cli["docker"]
        assert isinstance(api_docker, dict)
        assert isinstance(cli_docker, dict)
        assert api_docker["version"] == cli_docker["version"]
        assert api_docker["root"] == cli_docker["root"]

        missing = {**request, "image": "sparkdeploy.invalid/none:0"}
        assert _probe_on(lab_cluster, node, missing)["image"] is None
        assert _probe_on(lab_cluster, node, missing, "DOCKER_CONTEXT=probe-cli")["image"] is None
        down = _probe_on(lab_cluster, node, request, "DOCKER_HOST=unix:///run/no-docker.sock")
        assert "unix:///run/no-docker.sock" in str(down["docker"])
    finally:
        connection.run(["docker", "rm", "--force", "probe-labelled"], timeout=60, check=False)
        connection.run(["docker", "context", "rm", "--force", "probe-cli"], timeout=60, check=False)
        connection.run(["rm", "-r", "/var/tmp/probe-made"], timeout=60, check=False)


# nvidia-smi's answer to --query-compute-apps=pid,process_name,used_memory --format=csv, in the
# form it prints (a header naming used_gpu_memory [MiB], then one row a process; `[N/A]` where
# the driver does not count a process's memory).
COMPUTE_APPS_CSV = """\
pid, process_name, used_gpu_memory [MiB]
3858903, VLLM::EngineCore, 6265 MiB
44966, /opt/tritonserver/backends/python/triton_python_backend_stub, 974 MiB
5121, /usr/bin/python3 -m serve, with, commas, [N/A]
"""


def test_the_compute_apps_csv_of_nvidia_smi_is_read_row_by_row() -> None:
    assert parse_compute_apps(COMPUTE_APPS_CSV) == [
        {"pid": 3858903, "name": "VLLM::EngineCore", "used_bytes": 6265 << 20},
        {
            "pid": 44966,
            "name": "/opt/tritonserver/backends/python/triton_python_backend_stub",
            "used_bytes": 974 << 20,
        },
        {"pid": 5121, "name": "/usr/bin/python3 -m serve, with, commas", "used_bytes": None},
    ]
    assert parse_compute_apps("pid, process_name, used_gpu_memory [MiB]\n") == []


def test_gpu_processes_are_asked_of_nvidia_smi_where_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_processes() == {
        "checked": False,
        "reason": "nvidia-smi is not installed on this node",
    }
    stand_in = tmp_path / "nvidia-smi"
    stand_in.write_text(
        f'#!/bin/sh\n[ "$1" = --query-compute-apps=pid,process_name,used_memory ] && '
        f"[ \"$2\" = --format=csv ] || exit 9\ncat <<'END'\n{COMPUTE_APPS_CSV}END\n"
    )
    stand_in.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    answer = gpu_processes()
    assert answer["checked"]
    assert [p["pid"] for p in answer["processes"]] == [3858903, 44966, 5121]


def _meminfo(path: Path, free_kb: int, cached_kb: int) -> None:
    path.write_text(
        f"MemTotal:       124540000 kB\nMemFree:        {free_kb} kB\n"
        f"MemAvailable:   {free_kb + cached_kb} kB\nBuffers:           10000 kB\n"
        f"Cached:         {cached_kb} kB\nShmem:             20000 kB\n"
    )


@pytest.mark.parametrize(
    ("unified", "allowed", "free_gib", "dropped"),
    [
        (True, True, 90, True),  # short, unified, allowed: dropped
        (True, True, 115, False),  # enough free already
        (True, False, 90, False),  # the inventory does not allow it
        (False, True, 90, False),  # the page cache is available to a host engine anyway
    ],
)
def test_the_page_cache_is_dropped_only_when_it_stands_in_the_way(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    unified: bool,
    allowed: bool,
    free_gib: int,
    dropped: bool,
) -> None:
    meminfo = tmp_path / "meminfo"
    _meminfo(meminfo, free_gib << 20, 20 << 20)
    drops: list[int] = []

    def drop() -> None:
        drops.append(1)
        _meminfo(meminfo, (free_gib + 20) << 20, 0)

    monkeypatch.setattr(node_probe, "drop_page_cache", drop)
    request = {
        "unified_memory": unified,
        "required_free_bytes": 110 << 30,
        "drop_page_cache": allowed,
    }
    answer = check_memory(request, str(meminfo))
    assert answer["page_cache_dropped"] is dropped
    assert len(drops) == int(dropped)
    if dropped:
        assert answer["memory_before_drop"]["free"] == free_gib << 30
        assert answer["memory_before_drop"]["page_cache"] == (20 << 30) + (10000 - 20000) * 1024
        assert answer["memory"]["free"] == (free_gib + 20) << 30
    else:
        assert answer["memory"]["free"] == free_gib << 30


def test_a_refused_drop_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    meminfo = tmp_path / "meminfo"
    _meminfo(meminfo, 90 << 20, 20 << 20)

    def refused() -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(node_probe, "drop_page_cache", refused)
    request = {"unified_memory": True, "required_free_bytes": 110 << 30, "drop_page_cache": True}
    answer = check_memory(request, str(meminfo))
    assert not answer["page_cache_dropped"]
    assert "Permission denied" in answer["page_cache_error"]
