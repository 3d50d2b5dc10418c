"""A lost log stream on the lab: the head's link drops for LINK_DOWN_S while its engine boots
slowly (lab-single with STANDIN_FAULT=slow_boot), and the readiness gate still sees it ready,
every line of its log fed once. The bridge's port to the node is set down, so the node's packets
go nowhere (no FIN, no RST), as when a cable is pulled or a switch reboots."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest
from lab_flows import LAB_SINGLE_RECIPE, recipe_variant, with_env
from readiness_lab import Deployment

from lab.cluster import Lab
from sparkdeploy.errors import RemoteError
from sparkdeploy.remote.ssh import Connection, SshTarget, cached_connection
from sparkdeploy.remote.targets import node_target
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import make_plan
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.steps.readiness_gate import gate_for, wait_until_ready

pytestmark = pytest.mark.lab

SLOW_BOOT_S = 30
# The link drops once the follower streams the head's log, and is back well before the boot ends.
LINK_DOWN_AFTER_S = 3.0
LINK_DOWN_S = 15.0
# The slow boot and the link's outage with room for a loaded two-core machine.
READY_WITHIN_S = 120.0
DOCKER_S = 60.0


class Connects:
    """cached_connection, remembering when each connect began and ended and whether it did."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float, bool]] = []

    def __call__(self, target: SshTarget) -> Connection:
        began = time.monotonic()
        try:
            connection = cached_connection(target)
        except RemoteError:
            self.calls.append((began, time.monotonic(), False))
            raise
        self.calls.append((began, time.monotonic(), True))
        return connection


class LinkOutage(threading.Thread):
    """`node`'s port on the lab bridge down from `after_s` for `for_s`; `down_at`/`up_at` say
    when (time.monotonic()). The link comes back however the test ends."""

    def __init__(self, lab: Lab, node: str, *, after_s: float, for_s: float) -> None:
        super().__init__(name=f"link-outage-{node}", daemon=True)
        self.port = ["ip", "-n", lab.layout.bridge_netns, "link", "set"]
        self.port.append(lab.layout.node_bridge_port(node))
        self.after_s, self.for_s = after_s, for_s
        self.down_at = self.up_at = 0.0

    def run(self) -> None:
        time.sleep(self.after_s)
        subprocess.run([*self.port, "down"], check=True, timeout=10)
        self.down_at = time.monotonic()
        try:
            time.sleep(self.for_s)
        finally:
            subprocess.run([*self.port, "up"], check=True, timeout=10)
            self.up_at = time.monotonic()


def test_the_heads_link_down_during_a_slow_boot_is_resumed_and_the_boot_is_ready(
    lab_cluster: Lab, tmp_path: Path, deployments: list[Deployment]
) -> None:
    recipe = recipe_variant(
        tmp_path,
        "lab-link-down",
        LAB_SINGLE_RECIPE,
        with_env(STANDIN_FAULT=f"slow_boot:{SLOW_BOOT_S}"),
    )
    plan = make_plan(
        load_recipe(Path(recipe) / "recipe.toml"), load_cluster(lab_cluster.inventory_path)
    )
    deployment = Deployment(plan)
    deployments.append(deployment)
    deployment.start()
    head = plan.head.node
    connects = Connects()
    outage = LinkOutage(lab_cluster, head, after_s=LINK_DOWN_AFTER_S, for_s=LINK_DOWN_S)
    gate = gate_for(plan)
    outage.start()
    try:
        result = wait_until_ready(plan, gate, timeout_s=READY_WITHIN_S, connection_for=connects)
    finally:
        outage.join()
    # reconnected (the first connect is the attach), after the link was back
    reconnects = connects.calls[1:]
    assert reconnects, connects.calls
    assert reconnects[-1][2], connects.calls
    assert reconnects[0][0] > outage.down_at
    assert reconnects[-1][1] > outage.up_at
    assert result.timeline[-1].marker == "endpoint_ready"
    # every line the container printed up to ready, in order, each once
    # (merged as the follower reads it: docker keeps the engine's stdout and stderr apart)
    merged = ["sh", "-c", 'exec docker logs "$1" 2>&1', "sh", plan.head.container.name]
    logged = cached_connection(node_target(plan.head)).run(merged, timeout=DOCKER_S)
    printed = logged.stdout.decode().splitlines()
    fed = gate.watch.lines(head)
    assert fed == printed[: len(fed)]
    print(
        f"\nlink of {head} down {LINK_DOWN_S:.0f} s during a {SLOW_BOOT_S} s slow boot: the lost"
        f" stream noticed {reconnects[0][0] - outage.down_at:.1f} s after the link went down,"
        f" resumed {reconnects[-1][1] - outage.up_at:.1f} s after it came back"
        f" ({len(reconnects)} connects); ready after {result.ready_after_s:.1f} s"
    )
