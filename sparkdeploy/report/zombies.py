"""The automation that marks a flow run Crashed once its heartbeats stop: its worker, or the ops
host under it, died in the middle of the run, and nothing else would ever end it.

Prefect's self-hosted servers have no built-in zombie detection; its guide creates this
automation (https://docs.prefect.io/v3/advanced/detect-zombie-flows): a proactive trigger on
`prefect.flow-run.heartbeat` that fires when neither another heartbeat nor a final state of the
same run follows within the silence: three heartbeats missed. Flow runs beat every
PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds of their worker's environment (Prefect 3.9: 180 by
default, 30 at least; src/prefect/settings/models/flows.py), so the automation must be told the
workers' figure: a silence shorter than it would crash runs that are alive. A team that wants
dead runs found sooner sets 30 on every worker and applies this with 30. A deploy run marked
Crashed has ended, so the
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
# Prefect's default PREFECT_FLOWS_HEARTBEAT_FREQUENCY, and its minimum.
DEFAULT_HEARTBEAT_S = 180
MIN_HEARTBEAT_S = 30
# A run is a zombie after this many heartbeats missed, as Prefect's guide has it (3 x 30 s).
MISSED_HEARTBEATS = 3
HEARTBEAT_EVENT = "prefect.flow-run.heartbeat"
RUN_ENDED_EVENTS = frozenset(
    f"prefect.flow-run.{state}" for state in ("Completed", "Failed", "Cancelled", "Crashed")
)


def zombie_automation(heartbeat_s: int = DEFAULT_HEARTBEAT_S) -> AutomationCore:
    """Any flow run silent for MISSED_HEARTBEATS heartbeats of heartbeat_s (the workers'
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY) after one, without having ended: Crashed."""
    if heartbeat_s < MIN_HEARTBEAT_S:
        raise SparkDeployError(
            f"heartbeats every {heartbeat_s} s: Prefect sends them every {MIN_HEARTBEAT_S} s at"
            " most; give the workers' PREFECT_FLOWS_HEARTBEAT_FREQUENCY"
        )
    silence_s = MISSED_HEARTBEATS * heartbeat_s
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
    client: SyncPrefectClient, heartbeat_s: int = DEFAULT_HEARTBEAT_S
) -> UUID:
    """The zombie automation created, or updated when one of its name exists; its id."""
    automation = zombie_automation(heartbeat_s)
    existing = client.read_automations_by_name(ZOMBIE_AUTOMATION)
    if existing:
        client.update_automation(existing[0].id, automation)
        return existing[0].id
    return client.create_automation(automation)
