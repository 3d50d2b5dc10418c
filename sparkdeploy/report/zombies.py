"""The automation that marks a flow run Crashed once its heartbeats stop: its worker, or the ops
host under it, died in the middle of the run, and nothing else would ever end it.

Prefect's self-hosted servers have no built-in zombie detection; its guide creates this
automation (https://docs.prefect.io/v3/advanced/detect-zombie-flows): a proactive trigger on
`prefect.flow-run.heartbeat` that fires when neither another heartbeat nor a final state of the
same run follows within the silence. The runs beat only when their workers' environment sets
PREFECT_FLOWS_HEARTBEAT_FREQUENCY (30 s or more). A deploy run marked Crashed has ended, so the
next deploy takes its node locks over (sparkdeploy.steps.hold_nodes) instead of waiting for them.
`sparkdeploy zombies` applies it (idempotent: an automation of the same name is updated).
"""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

from sparkdeploy.errors import SparkDeployError

ZOMBIE_AUTOMATION = "sparkdeploy: crash flow runs whose heartbeats stopped"
# What the workers' PREFECT_FLOWS_HEARTBEAT_FREQUENCY is set to (Prefect's minimum).
HEARTBEAT_S = 30
# Three heartbeats missed, as Prefect's guide has it.
DEFAULT_SILENCE_S = 3 * HEARTBEAT_S
HEARTBEAT_EVENT = "prefect.flow-run.heartbeat"
RUN_ENDED_EVENTS = frozenset(
    f"prefect.flow-run.{state}" for state in ("Completed", "Failed", "Cancelled", "Crashed")
)


def zombie_automation(silence_s: float = DEFAULT_SILENCE_S) -> AutomationCore:
    """Any flow run silent for silence_s after a heartbeat, without having ended: Crashed."""
    if silence_s < 2 * HEARTBEAT_S:
        raise SparkDeployError(
            f"a silence of {silence_s:.0f} s would crash runs that are alive: heartbeats come"
            f" every {HEARTBEAT_S} s, so give at least {2 * HEARTBEAT_S} s"
        )
    return AutomationCore(
        name=ZOMBIE_AUTOMATION,
        description=(
            f"A flow run that sent no heartbeat for {silence_s:.0f} s and has not ended: its"
            " worker or host died. Marked Crashed, so its node locks can be taken over."
        ),
        trigger=EventTrigger(
            after={HEARTBEAT_EVENT},
            expect={HEARTBEAT_EVENT, *RUN_ENDED_EVENTS},
            match={"prefect.resource.id": ["prefect.flow-run.*"]},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=silence_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"No heartbeat for {silence_s:.0f} s: its worker or host died.",
            )
        ],
    )


def apply_zombie_automation(
    client: SyncPrefectClient, silence_s: float = DEFAULT_SILENCE_S
) -> UUID:
    """The zombie automation created, or updated when one of its name exists; its id."""
    automation = zombie_automation(silence_s)
    existing = client.read_automations_by_name(ZOMBIE_AUTOMATION)
    if existing:
        client.update_automation(existing[0].id, automation)
        return existing[0].id
    return client.create_automation(automation)
