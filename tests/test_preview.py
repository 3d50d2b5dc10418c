"""The preview's pure parts: the rates an inventory gives (else the stated defaults), the rows'
times, the verdict and the markdown; what the image and boot rows make of what nodes answer."""

from __future__ import annotations

from pathlib import Path

from sparkdeploy.remote.docker_cli import ContainerInfo
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import load_plan
from sparkdeploy.steps.hold_nodes import NodeHolder
from sparkdeploy.steps.preview import Preview, Row
from sparkdeploy.steps.preview.image import image_rows
from sparkdeploy.steps.preview.model import DEFAULT_DOWNLOAD_GB_PER_S, Rates, timed
from sparkdeploy.steps.preview.nodes import NodeLook, boot_rows

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "clusters" / "dgx-spark-4.toml"


def _inventory(tmp_path: Path, extra: dict[str, str]) -> Path:
    """The example inventory with lines added under the tables named."""
    text = EXAMPLE.read_text()
    for table, line in extra.items():
        # A table the example lacks is added at its end.
        text = (
            text.replace(f"{table}\n", f"{table}\n{line}\n", 1)
            if table in text
            else f"{text}\n{table}\n{line}\n"
        )
    path = tmp_path / "clusters" / "rated.toml"
    path.parent.mkdir()
    path.write_text(text)
    return path


def test_rates_come_from_the_inventory_else_from_stated_defaults(tmp_path: Path) -> None:
    plain = Rates.of(load_cluster(EXAMPLE))
    assert plain.download.gb_per_s == DEFAULT_DOWNLOAD_GB_PER_S
    assert {plain.download.source, plain.nas_read.source, plain.pull.source} == {"default"}
    rated = Rates.of(
        load_cluster(
            _inventory(
                tmp_path,
                {
                    "[hub]": "download_gb_per_s = 0.5",
                    "[nas]": "read_gb_per_s = 2",
                    "[docker]": "pull_gb_per_s = 0.25",
                    "[node_defaults]": "disk_gb_per_s = 4.0",
                    'name = "dgx4"': "disk_gb_per_s = 1.5",
                },
            )
        )
    )
    assert (rated.download.gb_per_s, rated.download.source) == (0.5, "inventory")
    assert rated.nas_read.gb_per_s == 2
    assert rated.pull.gb_per_s == 0.25
    assert rated.disks["dgx1"].gb_per_s == 4.0
    assert rated.disks["dgx4"].gb_per_s == 1.5
    assert rated.nas_to_disk("dgx1").gb_per_s == 2
    assert rated.nas_to_disk("dgx4").gb_per_s == 1.5


def test_a_rows_time_and_the_preview_verdict_and_markdown() -> None:
    rates = Rates.of(load_cluster(EXAMPLE))
    download = timed(
        Row("prefetch", "(flow host)", "org/m@main", "download", 10**9, "download 1 file"),
        10**9,
        rates.download,
    )
    assert download.expected_s == 10.0
    assert download.timing == "~10 s at 0.1 GB/s (default)"
    free = Row("hold-nodes", "dgx1", "node lock", "take", None, "free | really")
    moving = Preview("dep-1", "r", "c", ("dgx1",), {"replace": False}, (download, free))
    assert moving.step_seconds("prefetch") == 10.0
    assert moving.step_seconds("boot") == 0.0
    assert moving.verdict.startswith("a deploy now: 2 action(s)")
    text = moving.markdown()
    assert "| prefetch | (flow host) | org/m@main | download | 953.7 MiB (1000000000 B) |" in text
    assert "free \\| really" in text  # a cell's pipe is escaped
    settled = Preview("dep-1", "r", "c", ("dgx1",), {}, (Row("image", "dgx1", "i", "none", 0, ""),))
    assert settled.verdict == "everything is in place: a deploy now would move no byte"
    refused = Preview(
        "dep-1", "r", "c", ("dgx1",), {}, (Row("image", "dgx1", "i", "refuse", 0, ""),)
    )
    assert refused.verdict.startswith("a deploy now would be refused")
    assert refused.as_json()["rows"][0]["action"] == "refuse"


def _look(image_id: str | None, size: int = 0, free: int = 100 << 30) -> NodeLook:
    image = {"id": image_id, "size": size, "layers": 3, "labels": {}} if image_id else None
    return NodeLook({"root": "/var/lib/docker", "free_bytes": free}, image, [], [])


def test_image_rows_pull_where_missing_with_the_size_another_node_gives() -> None:
    plan = load_plan("dsv41-flash-eugr-0913-4x", str(EXAMPLE))
    if plan.docker_image_dir is not None:  # a built image: its rows need images/<dir>
        plan = plan.model_copy(update={"docker_image_dir": None})
    rates = Rates.of(load_cluster(EXAMPLE))
    names = [node.node for node in plan.nodes]
    looks = {name: _look("sha256:aa", 2 * 10**9) for name in names}
    looks[names[-1]] = _look(None)
    rows = {row.node: row for row in image_rows(plan, looks, rates)}
    assert rows[names[0]].action == "none"
    assert "present (sha256:aa)" in rows[names[0]].detail
    assert (rows[names[-1]].action, rows[names[-1]].bytes) == ("pull", 2 * 10**9)
    assert rows[names[-1]].expected_s == 20.0
    looks[names[-1]] = _look(None, free=1 << 30)
    short = {row.node: row for row in image_rows(plan, looks, rates)}[names[-1]]
    assert short.action == "refuse"
    assert "not enough disk" in short.detail


def _container(name: str, deployment: str, node: str) -> ContainerInfo:
    labels = {
        "sparkdeploy.deployment": deployment,
        "sparkdeploy.recipe": deployment.rsplit("-", 1)[0],
        "sparkdeploy.node": node,
        "sparkdeploy.rank": "0",
    }
    return ContainerInfo("id", name, "img", labels, "running", 0, "", "sha256:bb")


def test_boot_rows_remove_our_stale_copy_replace_a_holder_and_name_the_rest() -> None:
    plan = load_plan("lab-single", str(EXAMPLE))
    node = plan.nodes[0].node
    ours = _container("mine", plan.deployment_id, node)
    other = _container("theirs", "other-recipe-0123abcd", node)
    forged = _container("odd", "not a deployment", node)
    look = NodeLook({}, None, [ours, other, forged], [{"name": "db", "image": "postgres"}])
    holder = NodeHolder(node, "other-recipe-0123abcd", "2024-01-01T00:00:00+00:00", "r", "c", "m")
    rows = boot_rows(plan, {node: look}, {node: holder}, replace=True)
    assert [(row.subject, row.action) for row in rows] == [
        ("mine", "remove"),
        ("theirs", "replace"),
        ("odd", "none"),
        ("db", "none"),
    ]
    assert "stale copy of this deployment" in rows[0].detail
    assert "not ours (postgres): left alone" in rows[3].detail
    waiting = boot_rows(plan, {node: look}, {node: holder}, replace=False)
    assert waiting[1].action == "wait"
    gone = boot_rows(plan, {node: look}, {node: None}, replace=False)
    assert gone[1].action == "remove"
    assert "no longer holds the node" in gone[1].detail
