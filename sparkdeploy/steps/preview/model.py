"""What a preview says: one row per step, node and subject (a repo, a file, an image, a
container), with the action a deploy would take, its bytes and the time it is expected to take;
and the rates those times come from (the inventory's figures, else stated defaults)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from sparkdeploy.report.markdown import markdown_table
from sparkdeploy.spec.cluster import Cluster, Node
from sparkdeploy.units import human_bytes, human_duration

# The steps a preview reads, in the deploy's order.
STEPS = ("prefetch", "hold-nodes", "stage-engram", "image", "compose-model", "boot")
Action = Literal[
    "none",  # nothing to do: complete, present, skipped, left alone
    "adopt",  # found there, made ours after hashing or comparing `bytes`
    "download",  # from the hub into the NAS
    "copy",
    "resume",
    "pull",
    "build",
    "ship",  # from the node that built the image to the others
    "take",  # a free node held
    "take over",  # a node whose holder has ended (this deployment's earlier run: a redeploy)
    "replace",  # another deployment's hold or containers (replace=true)
    "remove",  # a stale container
    "compose",
    "wait",
    "refuse",
    "unknown",
]
# Where a node reads or writes bytes: the flow host for the prefetch.
FLOW_HOST = "(flow host)"

# The figures a preview assumes where the inventory gives none, stated wherever they are used.
DEFAULT_DOWNLOAD_GB_PER_S = 0.1  # a 1 Gbit/s uplink
DEFAULT_NAS_READ_GB_PER_S = 1.0  # NFS over 10 GbE
DEFAULT_DISK_GB_PER_S = 2.0  # a node's NVMe
DEFAULT_PULL_GB_PER_S = 0.1  # a registry across the uplink


@dataclass(frozen=True)
class Rate:
    """A transfer rate and where it comes from."""

    gb_per_s: float
    source: str  # "inventory" or "default"

    def seconds(self, count: int) -> float:
        return count / (self.gb_per_s * 1e9)


def _rate(value: float | None, default: float) -> Rate:
    return Rate(value, "inventory") if value is not None else Rate(default, "default")


def _slowest(first: Rate, second: Rate) -> Rate:
    return first if first.gb_per_s <= second.gb_per_s else second


@dataclass(frozen=True)
class Rates:
    """The rates of a cluster's transfers, from its inventory (sparkdeploy.spec.cluster)."""

    download: Rate  # hub -> NAS, on the flow host
    nas_read: Rate  # NAS -> flow host or node
    pull: Rate  # registry -> node
    disks: dict[str, Rate]  # node -> its local disk

    @classmethod
    def of(cls, cluster: Cluster) -> Rates:
        return cls(
            download=_rate(cluster.hub.download_gb_per_s, DEFAULT_DOWNLOAD_GB_PER_S),
            nas_read=_rate(cluster.nas.read_gb_per_s, DEFAULT_NAS_READ_GB_PER_S),
            pull=_rate(cluster.docker.pull_gb_per_s, DEFAULT_PULL_GB_PER_S),
            disks={node.name: _disk(node) for node in cluster.nodes},
        )

    def nas_to_disk(self, node: str) -> Rate:
        """An Engram copy or compare: the NAS read and the local disk, the slower of the two."""
        return _slowest(self.nas_read, self.disks.get(node, _disk(None)))


def _disk(node: Node | None) -> Rate:
    return _rate(node.disk_gb_per_s if node else None, DEFAULT_DISK_GB_PER_S)


@dataclass(frozen=True)
class Row:
    """What a deploy would do now about one subject of one step on one node."""

    step: str
    node: str  # FLOW_HOST for the prefetch
    subject: str
    action: Action
    bytes: int | None  # moved, hashed or compared (None: unknown, or none at stake)
    detail: str
    expected_s: float | None = None
    rate: Rate | None = None

    @property
    def timing(self) -> str:
        """`~N s at X GB/s (inventory)`; "" where no bytes are at stake."""
        if self.expected_s is None:
            return ""
        if self.rate is None:
            return f"~{human_duration(self.expected_s)}"
        return (
            f"~{human_duration(self.expected_s)} at {self.rate.gb_per_s:g} GB/s"
            f" ({self.rate.source})"
        )


def timed(row: Row, count: int, rate: Rate) -> Row:
    """The row with the time `count` bytes take at `rate` added to what it already expects."""
    return Row(
        row.step,
        row.node,
        row.subject,
        row.action,
        row.bytes,
        row.detail,
        (row.expected_s or 0.0) + rate.seconds(count),
        rate,
    )


@dataclass(frozen=True)
class Preview:
    """What a deploy of `deployment_id` would do now, step by step and node by node."""

    deployment_id: str
    recipe: str
    cluster: str
    nodes: tuple[str, ...]
    options: dict[str, bool]  # the deploy parameters previewed (replace, update_revisions)
    rows: tuple[Row, ...]

    def of_step(self, step: str) -> list[Row]:
        return [row for row in self.rows if row.step == step]

    @property
    def refusals(self) -> list[Row]:
        return [row for row in self.rows if row.action == "refuse"]

    def step_seconds(self, step: str) -> float:
        """A step's expected time: its nodes work at once, each node's rows one after another."""
        per_node: dict[str, float] = {}
        for row in self.of_step(step):
            per_node[row.node] = per_node.get(row.node, 0.0) + (row.expected_s or 0.0)
        return max(per_node.values(), default=0.0)

    @property
    def verdict(self) -> str:
        if self.refusals:
            return f"a deploy now would be refused: {len(self.refusals)} refusal(s) below"
        waits = [row for row in self.rows if row.action in ("wait", "unknown")]
        moving = [row for row in self.rows if row.action not in ("none", "wait", "unknown")]
        if not moving and not waits:
            return "everything is in place: a deploy now would move no byte"
        return (
            f"a deploy now: {len(moving)} action(s), {len(waits)} wait(s) or unknown(s); the"
            " steps' times below"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "deployment_id": self.deployment_id,
            "recipe": self.recipe,
            "cluster": self.cluster,
            "nodes": list(self.nodes),
            "options": self.options,
            "verdict": self.verdict,
            "step_seconds": {step: self.step_seconds(step) for step in STEPS},
            "rows": [asdict(row) for row in self.rows],
        }

    def markdown(self) -> str:
        """The preview as the `preview-<deployment>` artifact shows it (and the CLI prints)."""
        options = ", ".join(f"{key}={str(value).lower()}" for key, value in self.options.items())
        lines = [
            f"# Preview: {self.recipe} on {self.cluster} ({', '.join(self.nodes)})",
            "",
            f"Deployment `{self.deployment_id}`, a deploy with {options or 'its defaults'}:"
            f" {self.verdict}.",
            "",
            *markdown_table(
                ["step", "expected"],
                [[step, f"~{human_duration(self.step_seconds(step))}"] for step in STEPS],
            ),
            "",
            *markdown_table(
                ["step", "node", "subject", "action", "bytes", "expected", "detail"],
                [
                    [
                        row.step,
                        row.node,
                        row.subject,
                        row.action,
                        "" if row.bytes is None else f"{human_bytes(row.bytes)} ({row.bytes} B)",
                        row.timing,
                        row.detail,
                    ]
                    for row in self.rows
                ],
            ),
        ]
        return "\n".join(lines) + "\n"
