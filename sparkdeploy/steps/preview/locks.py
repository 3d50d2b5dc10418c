"""The node locks in a preview: who holds each node, as the Prefect server says, and what the
deploy's hold-nodes would do about it (sparkdeploy.steps.hold_nodes), without taking or writing
anything."""

from __future__ import annotations

from collections.abc import Mapping

import httpx
from prefect.exceptions import PrefectHTTPStatusError

from sparkdeploy.remote.docker_cli import deployments_present
from sparkdeploy.remote.ssh import SshTarget
from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.hold_nodes import NodeHolder, ended_runs, holder_decision, holders
from sparkdeploy.steps.preview.model import Action, Row


def hold_rows(
    plan: Plan, targets: Mapping[str, SshTarget], *, replace: bool, lock_timeout_s: float
) -> tuple[list[Row], dict[str, NodeHolder | None]]:
    """Who holds each node and what the deploy's hold-nodes would do about it; the holders
    (for the boot rows). Asked of the Prefect server, without taking or writing anything."""
    nodes = [node.node for node in plan.nodes]
    try:
        held = holders(plan.cluster, nodes)
        ended = ended_runs({holder.flow_run_id for holder in held.values() if holder})
    except (httpx.HTTPError, PrefectHTTPStatusError, OSError) as error:
        why = f"the Prefect server did not answer ({error}): who holds the node is unknown"
        return [_lock_row(node, "unknown", why) for node in nodes], {}
    to_ask = {
        node: [holder.deployment_id]
        for node, holder in held.items()
        if holder is not None
        and holder.deployment_id != plan.deployment_id
        and holder.flow_run_id in ended
    }
    left = deployments_present(targets, to_ask) if to_ask else {}
    rows = []
    for node in nodes:
        holder = held[node]
        if holder is None:
            rows.append(_lock_row(node, "take", "free"))
            continue
        run_ended = holder.flow_run_id in ended
        run = f"flow run {holder.flow_run_id}, {'ended' if run_ended else 'running'}"
        decision = holder_decision(
            holder,
            plan.deployment_id,
            None,
            run_ended=run_ended,
            containers_left=left.get(node, False),
            replacing=replace and holder.deployment_id != plan.deployment_id,
        )
        if holder.deployment_id == plan.deployment_id:
            if decision == "take over":
                why = f"held by this deployment ({run}): redeploy, its hold taken over"
                rows.append(_lock_row(node, "take over", why))
            else:
                why = (
                    f"held by another run of this deployment ({run}): wait for it, up to"
                    f" {lock_timeout_s:.0f} s"
                )
                rows.append(_lock_row(node, "wait", why))
            continue
        as_named = holder.taken_as(plan.cluster, node)
        who = f"held by deployment {holder.deployment_id}{as_named} ({run})"
        if decision == "take over" and replace:
            rows.append(_lock_row(node, "replace", f"{who}: replace"))
        elif decision == "take over":
            rows.append(
                _lock_row(node, "take over", f"{who}, nothing of it left on {node}: take over")
            )
        else:
            why = (
                "its flow run is still going"
                if not run_ended
                else f"its containers are still on {node}"
                if left.get(node)
                else f"whether its containers are still on {node} is unknown"
            )
            wait = (
                f"{who}: wait up to {lock_timeout_s:.0f} s ({why}), then fail; tear it down or"
                " deploy with replace=true"
            )
            rows.append(_lock_row(node, "wait", wait))
    return rows, held


def _lock_row(node: str, action: Action, why: str) -> Row:
    return Row("hold-nodes", node, "node lock", action, None, why)
