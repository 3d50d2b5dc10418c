"""docker on a node, the error handling of container removal (a scripted runner stands in for
the node: what is tested is how docker's answers are read)."""

from __future__ import annotations

import pytest

from lab.testing.local_node import ScriptedNode
from sparkdeploy.errors import RemoteError
from sparkdeploy.remote import docker_cli
from sparkdeploy.remote.docker_cli import remove_containers

CONTAINER = "d614187a1b5b71ed951d46cf5a7fb6bdfe9abba158f9a1507a7fd8bf65ac9cca"
IN_PROGRESS = (
    f"Error response from daemon: removal of container {CONTAINER} is already in progress"
).encode()


def test_a_removal_already_under_way_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(docker_cli, "REMOVAL_POLL_S", 0.0)
    node = ScriptedNode(
        (0, CONTAINER[:12].encode(), b""),  # stop
        (1, b"", IN_PROGRESS),  # rm
        (0, f"{CONTAINER}\nabc\n".encode(), b""),  # ps: still there
        (0, b"abc\n", b""),  # ps: gone
    )
    remove_containers(node, "node2", [CONTAINER[:12]], stop_timeout_s=1)
    assert [ran.argv[1] for ran in node.ran] == ["stop", "rm", "ps", "ps"]


def test_a_removal_that_never_finishes_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(docker_cli, "REMOVAL_POLL_S", 0.0)
    monkeypatch.setattr(docker_cli, "DOCKER_TIMEOUT_S", 0.0)
    node = ScriptedNode((0, b"", b""), (1, b"", IN_PROGRESS), (0, CONTAINER.encode(), b""))
    with pytest.raises(RemoteError, match=r"node node2: containers d614187a1b5b were still"):
        remove_containers(node, "node2", [CONTAINER[:12]], stop_timeout_s=1)


def test_another_removal_error_is_raised_with_dockers_words() -> None:
    node = ScriptedNode((0, b"", b""), (1, b"", b"Error response from daemon: device busy"))
    with pytest.raises(RemoteError, match=r"removing containers failed.*device busy"):
        remove_containers(node, "node2", [CONTAINER[:12]], stop_timeout_s=1)
