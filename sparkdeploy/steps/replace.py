"""Replacing a deployment: what a deploy with `replace` takes its nodes from, and what a failed
replacement brings back.

A deployment holds its nodes through the node locks (sparkdeploy.steps.hold_nodes) and runs as
containers labelled with its id (sparkdeploy.steps.status). A replacing deploy reads both before it
holds anything: every other deployment holding one of its nodes, once that deployment's own flow run
has ended, is replaced: its containers are removed just before the new ones boot (their logs kept,
the nodes kept for it meanwhile), and if the new deployment fails its boot, readiness gate or smoke
test, it is brought back on the same nodes from the same recipe. Bringing it back needs its plan
again, so a deployment whose containers' labels cannot be re-planned (its recipe is not under
recipes/ any more) is refused as a replacement, before anything is touched.

A record left by a replacement whose process was killed (sparkdeploy.steps.hold_nodes: `replaces`
after its run ended) names what served before that attempt: a new replacing deploy inherits it, so
the deployment to bring back is still the one that served, never the half-started attempt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from sparkdeploy.errors import ReplaceRefused, RollbackFailed, RolledBack
from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.hold_nodes import NodeHolder, Replaced, unfinished_replacement
from sparkdeploy.steps.status import DeploymentStatus


@dataclass(frozen=True)
class Replacement:
    """What a replacing deploy does to the deployments on its nodes."""

    # holder's deployment id -> the deployment to record as replaced (sparkdeploy.steps.hold_nodes).
    replacing: dict[str, Replaced]
    # The deployments to bring back if the new one fails, in the order they were found.
    bring_back: list[Replaced]

    @classmethod
    def none(cls) -> Replacement:
        return cls({}, [])

    def describe(self, deployment_id: str) -> str:
        if not self.bring_back:
            return f"deployment {deployment_id} replaces no other deployment"
        return f"deployment {deployment_id} replaces " + ", ".join(
            f"{old.deployment_id} ({old.recipe} on {', '.join(old.nodes)})"
            for old in self.bring_back
        )


def plan_replacement(
    plan: Plan,
    holders: Mapping[str, NodeHolder | None],
    run_ended: Callable[[str | None], bool],
    statuses: Sequence[DeploymentStatus],
) -> Replacement:
    """What replacing the deployments on `plan`'s nodes means, from the nodes' lock records
    (`holders`, with `run_ended` telling whether a holder's flow run has ended) and what runs on
    the cluster (`statuses`). A holder whose run is still going is not replaced (the deploy
    waits for it); one with no container left anywhere is taken over as it is without replace.
    Raises ReplaceRefused naming a deployment that could not be brought back."""
    by_id = {status.deployment_id: status for status in statuses}
    replacing: dict[str, Replaced] = {}
    for holder in holders.values():
        if holder is None or holder.deployment_id in replacing or not run_ended(holder.flow_run_id):
            continue
        unfinished = unfinished_replacement(holder, run_ended=True)
        if unfinished is not None:
            # An attempt that never finished: what served before it is what comes back.
            replacing[holder.deployment_id] = unfinished
            continue
        if holder.deployment_id == plan.deployment_id:
            continue
        status = by_id.get(holder.deployment_id)
        if status is None:
            continue  # nothing of it is left to replace
        if status.plan is None:
            raise ReplaceRefused(
                f"cannot replace deployment {holder.deployment_id} ({status.recipe}) on"
                f" {', '.join(status.nodes)}: {status.health}; it could not be brought back if"
                f" {plan.deployment_id} failed. Tear it down first (the teardown flow), then"
                " deploy"
            )
        since = min(
            (
                other.since
                for other in holders.values()
                if other and other.deployment_id == holder.deployment_id
            ),
            default=holder.since,
        )
        replacing[holder.deployment_id] = Replaced(
            deployment_id=holder.deployment_id,
            recipe=status.plan.recipe,
            nodes=tuple(node.node for node in status.plan.nodes),
            since=since,
        )
    bring_back: list[Replaced] = []
    for old in replacing.values():
        if old.deployment_id != plan.deployment_id and old not in bring_back:
            bring_back.append(old)
    return Replacement(replacing, bring_back)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0].rstrip(":") if text else type(error).__name__


def _serving_again(plan: Plan) -> str:
    nodes = ", ".join(node.node for node in plan.nodes)
    return (
        f"rolled back to {plan.deployment_id} ({plan.recipe} on {nodes}), which is serving"
        f" again at {plan.endpoint}"
    )


def bring_back(
    failure: BaseException,
    plan: Plan,
    replaced: Sequence[Replaced],
    redeploy: Callable[[Replaced], Plan],
) -> RolledBack | RollbackFailed:
    """A failed replacement's rollback: each replaced deployment up again on its nodes
    (`redeploy` returns its plan), a failure of one stopping none of the others. Returns the
    error the run then fails with, naming what serves again and what does not: RolledBack, or
    RollbackFailed when one could not be brought back."""
    brought: list[Plan] = []
    lost: list[tuple[Replaced, BaseException]] = []
    for old in replaced:
        try:
            brought.append(redeploy(old))
        except Exception as error:
            lost.append((old, error))
    message = rollback_message(failure, plan, brought, lost)
    return RollbackFailed(message) if lost else RolledBack(message)


def rollback_message(
    failure: BaseException,
    plan: Plan,
    brought_back: Sequence[Plan],
    not_brought_back: Sequence[tuple[Replaced, BaseException]] = (),
) -> str:
    """The failed replacement's run message: the failure, then what serves again and what could
    not be brought back."""
    lines = [f"{plan.deployment_id} ({plan.recipe}) failed: {_first_line(failure)}"]
    lines += [_serving_again(old) for old in brought_back]
    lines += [
        f"rolling back to {old.deployment_id} ({old.recipe} on {', '.join(old.nodes)}) failed"
        f" too: {_first_line(error)}; nothing of ours serves on {', '.join(old.nodes)}: deploy"
        f" {old.recipe} (or another recipe) there"
        for old, error in not_brought_back
    ]
    return "\n".join(lines) + f"\n\nthe failure of {plan.deployment_id}:\n{failure}"
