"""What a deploy does about each held node: it is this flow run's, its holder is provably gone
(take it over), or it waits; and, for the nodes it waits for, why, as its messages say."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

from prefect.client.orchestration import SyncPrefectClient
from prefect.exceptions import ObjectNotFound

from sparkdeploy.steps.hold_nodes.api import _api
from sparkdeploy.steps.hold_nodes.records import (
    NodeHolder,
    Replaced,
    _read_holders,
    limit_name,
    machine_label,
)
from sparkdeploy.steps.hold_nodes.runs import _ended_runs

# What to do about a node's holder: it is this flow run ("ours"), provably gone ("take over"),
# or to be waited for.
Decision = Literal["ours", "take over", "wait"]
# node -> deployment ids, to whether any container of them is on that node (None: the node could
# not be asked). sparkdeploy.remote.docker_cli.deployments_present, over SSH.
ContainerCheck = Callable[[dict[str, list[str]]], dict[str, bool | None]]


def _describe_blockers(
    client: SyncPrefectClient,
    cluster: str,
    machines: Mapping[str, str],
    why: dict[str, str],
) -> str:
    described = []
    current = _read_holders(client, machines)
    for node, machine in machines.items():
        try:
            limit = _api(client.read_global_concurrency_limit_by_name, limit_name(machine))
        except ObjectNotFound:
            continue  # never taken: the attempt that failed took no slot anywhere
        if limit.active_slots < limit.limit:
            continue
        holder = current[node]
        if holder is None:
            described.append(
                f"{node} (machine {machine_label(machine)}) is held by an unrecorded holder (a"
                " deploy taking it right now, or one that crashed while taking it: if no"
                f" deployment runs there, reset the limit `{limit_name(machine)}` to 0 active"
                " slots in the Prefect UI)"
            )
        else:
            run = f", flow run {holder.flow_run_id}" if holder.flow_run_id else ""
            reason = f" ({why[node]})" if node in why else ""
            described.append(
                f"{node} is held by deployment {holder.deployment_id}"
                f"{holder.taken_as(cluster, node)} since {holder.since}{run}{reason}"
            )
    return "; ".join(described) or "the nodes were released while this deploy was giving up"


def holder_decision(
    holder: NodeHolder,
    deployment_id: str,
    flow_run_id: str | None,
    *,
    run_ended: bool,
    containers_left: bool | None,
    replacing: bool = False,
) -> Decision:
    """What a deploy of `deployment_id` in flow run `flow_run_id` does about a node's holder.

    `run_ended`: the holder's flow run is final or gone (a holder recorded outside any flow run
    counts as ended: no run of it can still be going). `containers_left`: whether the holder's
    deployment (and, for an unfinished replacement, the deployment it replaced) has a container
    on the node (None: the node could not be asked; only consulted for another deployment).
    `replacing`: the deploy replaces the holder's deployment. A holder is taken over only when
    its run has ended and it is replaced, is this deployment, or has nothing left on the node. A
    run that is still going (a concurrent deploy, of this deployment or another) is waited for.
    """
    if holder.deployment_id == deployment_id and holder.flow_run_id == flow_run_id:
        return "ours"
    if not run_ended:
        return "wait"
    if replacing or holder.deployment_id == deployment_id:
        return "take over"  # boot replaces what is left of it
    return "take over" if containers_left is False else "wait"


def unfinished_replacement(holder: NodeHolder, run_ended: bool) -> Replaced | None:
    """The deployment a holder was replacing when its flow run ended without committing or
    giving the node back (its process was killed), else None."""
    return holder.replaces if run_ended else None


def _decide(
    client: SyncPrefectClient,
    current: dict[str, NodeHolder | None],
    deployment_id: str,
    flow_run_id: str | None,
    containers_on: ContainerCheck | None,
    replacing: Mapping[str, Replaced],
) -> tuple[dict[str, Decision], dict[str, str]]:
    """A decision for every held node, and why each node to wait for is waited for."""
    held = {node: holder for node, holder in current.items() if holder is not None}
    others = {
        node: holder
        for node, holder in held.items()
        if holder.deployment_id != deployment_id or holder.flow_run_id != flow_run_id
    }
    ended = (
        _ended_runs(client, {holder.flow_run_id for holder in others.values()}) if others else set()
    )
    # Only another deployment whose run has ended is worth the SSH round trip; an unfinished
    # replacement is judged by the containers of both deployments.
    to_ask: dict[str, list[str]] = {}
    for node, holder in others.items():
        if holder.flow_run_id not in ended or holder.deployment_id in replacing:
            continue
        unfinished = unfinished_replacement(holder, run_ended=True)
        ids = {holder.deployment_id, *([unfinished.deployment_id] if unfinished else [])}
        ids.discard(deployment_id)
        if ids:
            to_ask[node] = sorted(ids)
    left: dict[str, bool | None] = dict.fromkeys(to_ask)
    if to_ask and containers_on is not None:
        left.update(containers_on(to_ask))
    decisions: dict[str, Decision] = {}
    why: dict[str, str] = {}
    for node, holder in held.items():
        run_ended = holder.flow_run_id in ended
        decisions[node] = holder_decision(
            holder,
            deployment_id,
            flow_run_id,
            run_ended=run_ended,
            containers_left=left.get(node, False),
            replacing=holder.deployment_id in replacing,
        )
        if decisions[node] != "wait":
            continue
        unfinished = unfinished_replacement(holder, run_ended)
        if not run_ended:
            why[node] = "its flow run is still going"
        elif left.get(node) is None:
            why[node] = (
                f"its flow run has ended; whether its containers are gone from {node} is unknown"
            )
        elif unfinished is not None:
            why[node] = (
                f"its flow run ended while it was replacing deployment"
                f" {unfinished.deployment_id} ({unfinished.recipe}), and containers of one of"
                f" them are still on {node}: deploy with replace=true (a failure then brings"
                f" {unfinished.deployment_id} back) or tear them down"
            )
        else:
            why[node] = (
                f"its flow run has ended but its containers are still on {node}: tear that"
                " deployment down, or deploy with replace=true"
            )
    return decisions, why
