"""Taking over holders provably gone: their records rewritten as this flow run's (the slot
passes from the old holder to the new), under the machines' takeover mutex so two deploys never
both take over one stale holder."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient

from sparkdeploy.steps.hold_nodes.api import _api
from sparkdeploy.steps.hold_nodes.records import (
    NodeHolder,
    Replaced,
    _read_holders,
    _write_holder,
    takeover_name,
)
from sparkdeploy.steps.hold_nodes.slots import _increment

# The takeover mutex's lease: Prefect's minimum; it is held for two requests.
TAKEOVER_LEASE_S = 60.0


def _take_over(
    client: SyncPrefectClient,
    cluster: str,
    stale: dict[str, NodeHolder],
    deployment_id: str,
    flow_run_id: str | None,
    replacing: Mapping[str, Replaced],
    *,
    log: Callable[[str], None],
    warn: Callable[[str], None],
) -> list[str]:
    """The stale holders' nodes recorded as this run's, under their takeover mutex; the nodes
    taken over (none while another deploy is taking them over)."""
    names = [takeover_name(holder.machine_id) for holder in stale.values()]
    response = _increment(client, names, lease_s=TAKEOVER_LEASE_S)
    if response is None:
        return []
    taken = []
    try:
        # Re-read under the mutex: another deploy may have taken over (or the holder let go)
        # since the decision.
        now = _read_holders(client, {node: holder.machine_id for node, holder in stale.items()})
        since = datetime.now(UTC).isoformat(timespec="seconds")
        for node, holder in stale.items():
            if now[node] != holder:
                continue
            same = holder.deployment_id == deployment_id
            replaced = replacing.get(holder.deployment_id)
            _write_holder(
                client,
                NodeHolder(
                    node,
                    deployment_id,
                    holder.since if same else since,
                    flow_run_id,
                    cluster,
                    holder.machine_id,
                    replaced,
                    took_over_from=holder.flow_run_id if same and replaced is None else None,
                ),
            )
            taken.append(node)
            run = f"flow run {holder.flow_run_id}" if holder.flow_run_id else "no flow run"
            if replaced is not None:
                brought_back = (
                    f"; {replaced.deployment_id} comes back if this deployment fails"
                    if replaced.deployment_id != deployment_id
                    else ""
                )
                warn(
                    f"node {node} of cluster {cluster}: replacing deployment"
                    f" {holder.deployment_id}{holder.taken_as(cluster, node)} (holder since"
                    f" {holder.since}, {run} has ended){brought_back}"
                )
            elif same:
                log(f"node {node}: deployment {deployment_id} goes on holding it ({run} has ended)")
            else:
                warn(
                    f"node {node} of cluster {cluster}: taking it over from deployment"
                    f" {holder.deployment_id}{holder.taken_as(cluster, node)} (holder since"
                    f" {holder.since}, {run}): its flow run has ended and none of its containers"
                    " is left on the node"
                )
    finally:
        _api(client.release_concurrency_slots_with_lease, UUID(response.json()["lease_id"]))
    return taken
