"""Images: error classification and build contexts (unit), pull/build/distribute on the lab."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from lab.cluster import Lab
from sparkdeploy.errors import ImageError, RemoteError, TransientRemoteError
from sparkdeploy.remote.docker_cli import registry_error
from sparkdeploy.remote.runner import CommandResult
from sparkdeploy.remote.ssh import cached_connection
from sparkdeploy.steps.image import check_built_elsewhere, ensure_image, same_image_id
from sparkdeploy.steps.image.distribute import registry_reference
from sparkdeploy.steps.image.source import (
    CONTEXT_LABEL,
    BuiltElsewhere,
    build_context,
    built_elsewhere_refusal,
    image_source,
)


def _failed(stderr: str) -> CommandResult:
    return CommandResult(("docker", "pull", "x"), 1, b"", stderr.encode())


@pytest.mark.parametrize(
    ("stderr", "kind", "hint"),
    [
        ("manifest for r/x:1 not found: manifest unknown", ImageError, "does not exist"),
        ("pull access denied for x, repository does not exist", ImageError, "does not exist"),
        ("unauthorized: authentication required", ImageError, "docker login"),
        (
            'Get "http://r/v2/": dial tcp r:5000: connect: connection refused',
            TransientRemoteError,
            "retrying",
        ),
        (
            "received unexpected HTTP status: 503 Service Unavailable",
            TransientRemoteError,
            "retrying",
        ),
        ("dial udp 10.0.0.53:53: connect: network is unreachable", ImageError, "mirror"),
        ("write /var/lib/docker/tmp/x: no space left on device", ImageError, "free disk"),
        (
            "Cannot connect to the Docker daemon at unix:///var/run/docker.sock",
            RemoteError,
            "start dockerd",
        ),
    ],
)
def test_registry_errors_are_classified(stderr: str, kind: type, hint: str) -> None:
    error = registry_error("node2", "r/x:1", "pulling", _failed(stderr))
    assert type(error) is kind
    assert "node node2" in str(error)
    assert "r/x:1" in str(error)
    assert hint in str(error)


def test_registry_reference_replaces_the_image_registry() -> None:
    assert registry_reference("10.0.0.2:5000", "glm:local") == "10.0.0.2:5000/glm:local"
    assert registry_reference("reg:5000", "lab/x:1") == "reg:5000/lab/x:1"
    assert registry_reference("reg:5000", "nvcr.io/nvidia/vllm:25") == "reg:5000/nvidia/vllm:25"
    assert registry_reference("reg:5000", "localhost/x") == "reg:5000/x"


def test_build_context_digest_follows_content_not_mtime(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "file").write_text("one")
    first = build_context(tmp_path)
    (tmp_path / "sub" / "file").touch()
    assert build_context(tmp_path).digest == first.digest
    (tmp_path / "sub" / "file").write_text("two")
    assert build_context(tmp_path).digest != first.digest
    with tarfile.open(fileobj=io.BytesIO(first.tar)) as tar:
        assert sorted(tar.getnames()) == ["Dockerfile", "sub", "sub/file"]


def test_build_context_needs_a_dockerfile(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="no Dockerfile"):
        build_context(tmp_path)


def test_image_source_is_a_build_context_here_or_built_elsewhere(tmp_path: Path) -> None:
    assert image_source("r", None, tmp_path) == (None, None)
    (tmp_path / "images" / "here").mkdir(parents=True)
    (tmp_path / "images" / "here" / "Dockerfile").write_text("FROM scratch\n")
    assert image_source("r", "here", tmp_path) == (tmp_path / "images" / "here", None)
    # A directory without a Dockerfile is no build context either.
    (tmp_path / "images" / "empty").mkdir()
    for missing in ("empty", "elsewhere"):
        assert image_source("r", missing, tmp_path) == (
            None,
            BuiltElsewhere("r", missing, tmp_path / "images" / missing),
        )


ELSEWHERE = BuiltElsewhere("glm53", "glm-r27", Path("/srv/sparkdeploy/images/glm-r27"))


def test_an_image_built_elsewhere_on_every_node_with_one_id_is_used() -> None:
    ids = {"node1": "sha256:a", "node2": "sha256:a"}
    assert built_elsewhere_refusal("glm:local", ids, ELSEWHERE) is None


def test_an_image_built_elsewhere_missing_or_odd_on_a_node_is_refused() -> None:
    ids = {"node1": "sha256:a", "node2": None, "node3": "sha256:b", "node4": None}
    refusal = built_elsewhere_refusal("glm:local", ids, ELSEWHERE)
    assert refusal is not None
    assert refusal.startswith("recipe glm53: glm:local cannot be built here")
    assert "docker_image_dir 'glm-r27' names /srv/sparkdeploy/images/glm-r27" in refusal
    assert "missing on node2, node4" in refusal
    assert "different images on node1 (sha256:a), node3 (sha256:b)" in refusal
    assert "at images/glm-r27/, or remove docker_image_dir" in refusal
    assert "or put glm:local on every node by hand" in refusal
    nowhere = built_elsewhere_refusal("glm:local", {"node1": None}, ELSEWHERE)
    assert nowhere is not None
    assert "missing on node1;" not in nowhere
    assert "missing on node1. Fix:" in nowhere


def _remove_image(lab: Lab, node: str, image: str) -> None:
    cached_connection(lab.ssh_target(node)).run(
        ["docker", "image", "rm", "--force", image], timeout=60, check=False
    )


@pytest.mark.lab
def test_pull_on_three_nodes_then_rerun_is_skipped(lab_cluster: Lab, lab_engine_image: str) -> None:
    targets = lab_cluster.ssh_targets()
    for node in lab_cluster.nodes:
        _remove_image(lab_cluster, node, lab_engine_image)
    lines: list[str] = []
    report = ensure_image(targets, lab_engine_image, log=lines.append)
    assert [n.action for n in report.nodes] == ["pulled"] * 3
    # node1 imported the image for the registry: its layers stay under the registry's tags.
    assert all(node.layers_moved >= 1 for node in report.nodes[1:])
    assert {n.image_id for n in report.nodes} == {report.image_id}
    assert any("Pull complete" in line for line in lines)

    again = ensure_image(targets, lab_engine_image, log=lines.append)
    assert [n.action for n in again.nodes] == ["present"] * 3
    assert again.layers_moved == 0
    assert again.image_id == report.image_id


def test_same_image_id_names_the_odd_and_the_missing_nodes() -> None:
    ids = {"node1": "sha256:a", "node2": "sha256:b", "node3": None, "node4": "sha256:a"}
    with pytest.raises(ImageError) as caught:
        same_image_id("x:1", ids, "node1")
    message = str(caught.value)
    assert "node1 has sha256:a" in message
    assert "node2 has sha256:b" in message
    assert "missing on node3" in message
    assert "node4" not in message
    assert same_image_id("x:1", {"node1": "sha256:a", "node2": "sha256:a"}, "node2") == "sha256:a"


@pytest.mark.lab
def test_a_node_whose_tag_points_elsewhere_is_brought_in_line(
    lab_cluster: Lab, lab_engine_image: str
) -> None:
    targets = lab_cluster.ssh_targets()
    ensure_image(targets, lab_engine_image)
    image = f"{lab_cluster.registry}/lab/odd-test:1"
    first = cached_connection(lab_cluster.ssh_target("node1"))
    first.run(["docker", "tag", lab_engine_image, image], timeout=60)
    first.run(["docker", "push", image], timeout=120)
    odd = cached_connection(lab_cluster.ssh_target("node3"))
    odd.run(
        ["docker", "build", "-t", image, "-"],
        timeout=120,
        stdin=f"FROM {lab_engine_image}\nLABEL odd=1\n".encode(),
    )
    try:
        report = ensure_image(targets, image)
        assert [n.action for n in report.nodes] == ["pulled"] * 3
        assert report.image_id == ensure_image(targets, lab_engine_image).image_id
    finally:
        for node in lab_cluster.nodes:
            _remove_image(lab_cluster, node, image)


@pytest.mark.lab
def test_built_image_lands_on_every_node(
    lab_cluster: Lab, lab_engine_image: str, tmp_path: Path
) -> None:
    (tmp_path / "Dockerfile").write_text(
        f"FROM {lab_engine_image}\nLABEL org.sparkdeploy.test=built\n"
    )
    image = "lab/images-test:built"
    targets = lab_cluster.ssh_targets()
    for node in lab_cluster.nodes:
        _remove_image(lab_cluster, node, image)
    try:
        report = ensure_image(targets, image, image_dir=tmp_path, registry=lab_cluster.registry)
        assert [n.action for n in report.nodes] == ["built", "distributed", "distributed"]
        for node in lab_cluster.nodes:
            labels = cached_connection(lab_cluster.ssh_target(node)).run(
                ["docker", "image", "inspect", "--format", "{{json .Config.Labels}}", image],
                timeout=60,
            )
            assert b'"org.sparkdeploy.test":"built"' in labels.stdout
            assert CONTEXT_LABEL.encode() in labels.stdout
        again = ensure_image(targets, image, image_dir=tmp_path, registry=lab_cluster.registry)
        assert [n.action for n in again.nodes] == ["present"] * 3
        assert again.image_id == report.image_id

        # Without a registry: a changed context is rebuilt and streamed with save/load.
        (tmp_path / "Dockerfile").write_text(
            f"FROM {lab_engine_image}\nLABEL org.sparkdeploy.test=streamed\n"
        )
        streamed = ensure_image(targets, image, image_dir=tmp_path, registry=None)
        assert [n.action for n in streamed.nodes] == ["built", "distributed", "distributed"]
        assert streamed.image_id != report.image_id
    finally:
        for node in lab_cluster.nodes:
            _remove_image(lab_cluster, node, image)


@pytest.mark.lab
def test_unknown_image_is_a_clear_permanent_error(lab_cluster: Lab) -> None:
    targets = lab_cluster.ssh_targets()
    with pytest.raises(ImageError, match="does not exist in its registry"):
        ensure_image(targets, f"{lab_cluster.registry}/lab/no-such-image:1")
    # A docker.io-style name the mirror lacks: docker falls back to the unreachable upstream.
    with pytest.raises(ImageError, match="mirror does not hold this image"):
        ensure_image(targets, "lab/no-such-image:1")


@pytest.mark.lab
def test_an_image_built_elsewhere_is_used_as_the_nodes_hold_it_or_refused(
    lab_cluster: Lab, lab_engine_image: str, tmp_path: Path
) -> None:
    """Tagged by hand on every node, without our labels, from a directory not here: used as it
    is with a warning; once a node lacks it, refused naming that node (nothing pulled)."""
    image = "lab/built-elsewhere:1"
    source = BuiltElsewhere("hand-built", "not-here", tmp_path / "images" / "not-here")
    targets = lab_cluster.ssh_targets()
    for node in lab_cluster.nodes:
        cached_connection(lab_cluster.ssh_target(node)).run(
            ["docker", "tag", lab_engine_image, image], timeout=60
        )
    try:
        warnings: list[str] = []
        check_built_elsewhere(targets, image, source, warn=warnings.append)
        report = ensure_image(targets, image, built_elsewhere=source, warn=warnings.append)
        assert [n.action for n in report.nodes] == ["present"] * 3
        assert report.image_id == ensure_image(targets, lab_engine_image).image_id
        assert len(warnings) == 2
        assert all("cannot be rebuilt here" in warning for warning in warnings)

        _remove_image(lab_cluster, "node2", image)
        with pytest.raises(ImageError, match="missing on node2\\. Fix: add") as refused:
            check_built_elsewhere(targets, image, source)
        assert "recipe hand-built" in str(refused.value)
        with pytest.raises(ImageError, match="missing on node2"):
            ensure_image(targets, image, built_elsewhere=source)
        absent = cached_connection(lab_cluster.ssh_target("node2")).run(
            ["docker", "image", "inspect", image], timeout=60, check=False
        )
        assert absent.exit_code != 0  # neither pulled nor built
    finally:
        for node in lab_cluster.nodes:
            _remove_image(lab_cluster, node, image)
