"""sparkdeploy.remote.ssh against the lab's real sshd: quoting, exit codes, timeouts, stdin, Python
sources, host-key checking, transient connect failures, fan-out and the connection cache."""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from lab.cluster import Lab
from sparkdeploy.errors import RemoteError, TransientRemoteError
from sparkdeploy.remote.ssh import Connection, cached_connection, close_cached, connect, on_all

pytestmark = pytest.mark.lab

TIMEOUT_S = 30.0


@pytest.fixture
def node1(lab_cluster: Lab) -> Connection:
    return cached_connection(lab_cluster.ssh_target("node1"))


def test_argv_reaches_the_node_verbatim_and_no_shell_sees_it(node1: Connection) -> None:
    marker = f"/tmp/not-created-{secrets.token_hex(4)}"
    argv = ["printf", "%s|", "two words", f"$(touch {marker})", "'quoted'", "a;b", "*", ""]
    result = node1.run(argv, timeout=TIMEOUT_S)
    assert result.stdout == f"two words|$(touch {marker})|'quoted'|a;b|*||".encode()
    assert result.argv == tuple(argv)
    assert node1.run(["test", "-e", marker], timeout=TIMEOUT_S, check=False).exit_code == 1


def test_small_packets_go_out_at_once(node1: Connection) -> None:
    """Nagle off: with it on, every command round trip waited out the node's delayed ACK."""
    transport = node1._client.get_transport()
    assert transport is not None
    assert isinstance(transport.sock, socket.socket)
    assert transport.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


def test_non_zero_exit_raises_with_node_command_and_stderr(node1: Connection) -> None:
    argv = ["sh", "-c", 'echo "disk on fire" >&2; exit 3']
    with pytest.raises(RemoteError) as raised:
        node1.run(argv, timeout=TIMEOUT_S)
    message = str(raised.value)
    assert node1.target.host in message
    assert "exited 3" in message
    assert "disk on fire" in message
    assert not isinstance(raised.value, TransientRemoteError)
    unchecked = node1.run(argv, timeout=TIMEOUT_S, check=False)
    assert (unchecked.exit_code, unchecked.stderr) == (3, b"disk on fire\n")


def test_a_command_that_outlives_its_timeout_raises(node1: Connection) -> None:
    with pytest.raises(RemoteError, match=r"did not finish within 0\.5 s"):
        node1.run(["sleep", "30"], timeout=0.5)
    assert node1.run(["true"], timeout=TIMEOUT_S).exit_code == 0


def test_stdin_and_large_outputs_pass_through_whole(node1: Connection) -> None:
    # Repeated: sshd may send the exit status while output is still queued behind the window,
    # and an early version lost that tail about one run in three.
    for size in [3 << 20] * 8 + [40 << 20]:
        payload = secrets.token_bytes(size)
        assert node1.run(["cat"], timeout=TIMEOUT_S, stdin=payload).stdout == payload
    both = ["sh", "-c", "head -c 5000000 /dev/zero; head -c 3000000 /dev/zero >&2; exit 3"]
    for _ in range(5):
        result = node1.run(both, timeout=TIMEOUT_S, check=False)
        assert (len(result.stdout), len(result.stderr), result.exit_code) == (5000000, 3000000, 3)


def test_run_python_gets_args_and_its_own_stdin(node1: Connection) -> None:
    padding = "#" * 300_000  # beyond the kernel's 128 KiB limit for one argument
    source = f"{padding}\nimport sys\nprint(repr(sys.argv[1:]), sys.stdin.read())\n"
    result = node1.run_python(source, ["a b", "$HOME", "'"], timeout=TIMEOUT_S, stdin=b"in")
    assert result.stdout == b"['a b', '$HOME', \"'\"] in\n"
    with pytest.raises(RemoteError, match="ZeroDivisionError"):
        node1.run_python("1 / 0", [], timeout=TIMEOUT_S)


def test_unknown_or_changed_host_keys_are_rejected(lab_cluster: Lab, tmp_path: Path) -> None:
    target = lab_cluster.ssh_target("node1")
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    with pytest.raises(RemoteError, match=r"not in .*empty_known_hosts") as unknown:
        connect(dataclasses.replace(target, known_hosts=str(empty)), attempts=1)
    assert not isinstance(unknown.value, TransientRemoteError)

    node2_key = Path(target.known_hosts).read_text().splitlines()[1].split(" ", 1)[1]
    wrong = tmp_path / "wrong_known_hosts"
    wrong.write_text(f"{target.host} {node2_key}\n")
    with pytest.raises(RemoteError, match="host key differs"):
        connect(dataclasses.replace(target, known_hosts=str(wrong)), attempts=1)


def test_a_refused_connection_is_transient_after_the_retries(lab_cluster: Lab) -> None:
    closed_port = dataclasses.replace(lab_cluster.ssh_target("node1"), port=2)
    with pytest.raises(TransientRemoteError, match=r"root@.*:2: cannot connect"):
        connect(closed_port, attempts=2)


def test_on_all_returns_by_node_and_names_the_failing_node(lab_cluster: Lab) -> None:
    targets = lab_cluster.ssh_targets()
    hostnames = on_all(targets, lambda c: c.run(["hostname"], timeout=TIMEOUT_S).stdout.strip())
    assert hostnames == {node: node.encode() for node in lab_cluster.nodes}

    def fail_on_node2(connection: Connection) -> None:
        name = connection.run(["hostname"], timeout=TIMEOUT_S).stdout.strip().decode()
        connection.run(["false"] if name == "node2" else ["true"], timeout=TIMEOUT_S)

    with pytest.raises(RemoteError, match=r"^node node2: .*`false` exited 1"):
        on_all(targets, fail_on_node2)

    def fail_naming_node2(connection: Connection) -> None:
        name = connection.run(["hostname"], timeout=TIMEOUT_S).stdout.strip().decode()
        if name == "node2":
            raise RemoteError("node node2: disk full")

    with pytest.raises(RemoteError) as named_once:
        on_all(targets, fail_naming_node2)
    assert str(named_once.value) == "node node2: disk full"


def test_the_cache_reuses_a_live_connection_and_replaces_a_closed_one(lab_cluster: Lab) -> None:
    target = lab_cluster.ssh_target("node3")
    first = cached_connection(target)
    assert cached_connection(target) is first
    first.close()
    second = cached_connection(target)
    assert second is not first
    assert second.run(["true"], timeout=TIMEOUT_S).exit_code == 0
    close_cached()
    assert not second.is_active


def _parent(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def _cut_connection_under(lab: Lab, node: str, marker: str) -> tuple[int, float]:
    """Once the command has written its PID to /tmp/<marker> on the node, SIGKILL the sshd
    processes serving its connection (those below the node's listening sshd), as when sshd is
    killed or the node reboots: the TCP connection closes under the command. Returns the
    command's PID and when the connection was cut."""
    master_sshd = lab.status()["processes"][f"{node}/sshd"]["pid"]
    pid_file = lab.layout.node_dir(node) / "tmp" / marker
    deadline = time.monotonic() + TIMEOUT_S
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)
    command_pid = int(pid_file.read_text())
    session = []
    pid = _parent(command_pid)
    while pid != master_sshd:
        session.append(pid)
        pid = _parent(pid)
    cut_at = time.monotonic()
    for pid in session:
        os.kill(pid, signal.SIGKILL)
    return command_pid, cut_at


def test_a_connection_lost_mid_command_fails_fast_as_transient_and_the_retry_reconnects(
    lab_cluster: Lab,
) -> None:
    node = "node2"
    target = lab_cluster.ssh_target(node)
    connection = cached_connection(target)
    marker = f"pid-{secrets.token_hex(4)}"
    failures: list[BaseException] = []

    def long_command() -> None:
        try:
            connection.run(["sh", "-c", f'echo $$ > "/tmp/{marker}"; exec sleep 30'], timeout=60)
        except BaseException as error:
            failures.append(error)

    runner = threading.Thread(target=long_command)
    runner.start()
    command_pid, cut_at = _cut_connection_under(lab_cluster, node, marker)
    runner.join(TIMEOUT_S)
    failed_after = time.monotonic() - cut_at
    print(f"the lost connection failed the command after {failed_after:.2f} s")
    os.kill(command_pid, signal.SIGKILL)
    [failure] = failures
    assert isinstance(failure, TransientRemoteError), failure
    assert "connection was lost" in str(failure)
    assert "sleep 30" in str(failure)
    assert str(target) in str(failure)
    assert failed_after < 3, f"the loss was noticed after {failed_after:.1f} s"
    retried = cached_connection(target)
    assert retried is not connection
    assert retried.run(["true"], timeout=TIMEOUT_S).exit_code == 0


def test_a_stream_whose_connection_is_lost_ends_lost_without_an_exit_status(
    lab_cluster: Lab,
) -> None:
    node = "node3"
    marker = f"pid-{secrets.token_hex(4)}"
    stream = cached_connection(lab_cluster.ssh_target(node)).stream_lines(
        ["sh", "-c", f'echo $$ > "/tmp/{marker}"; exec sleep 30'], timeout=60
    )
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.extend(stream))
    reader.start()
    command_pid, cut_at = _cut_connection_under(lab_cluster, node, marker)
    reader.join(TIMEOUT_S)
    ended_after = time.monotonic() - cut_at
    os.kill(command_pid, signal.SIGKILL)
    assert lines == []
    assert (stream.ended, stream.exit_code) == ("lost", None)
    assert ended_after < 3, f"the loss was noticed after {ended_after:.1f} s"
