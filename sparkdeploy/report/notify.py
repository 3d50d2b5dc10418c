"""The automation that tells a person: the watchdog's unhealthy event, sent through a
notification block of the operator's choice (Slack, e-mail, PagerDuty, a custom webhook, ...).

The repair itself is a deployment trigger in prefect.yaml (on the `deploy/deploy` deployment,
created by `prefect deploy`); this one needs the operator's block, which exists only on their
Prefect server, so it is applied by `sparkdeploy notify BLOCK_TYPE/BLOCK_NAME` (idempotent: an
automation of the same name is updated). Prefect's automations: https://docs.prefect.io/v3/
how-to-guides/automations/creating-automations; notification blocks and their `{{ subject }}`
and `{{ body }}`: https://docs.prefect.io/v3/how-to-guides/automations/custom-notifications.
"""

from __future__ import annotations

from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient
from prefect.events.actions import SendNotification
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
from prefect.exceptions import ObjectNotFound

from sparkdeploy.errors import SparkDeployError
from sparkdeploy.spec.events import RESOURCE_PREFIX, UNHEALTHY

NOTIFY_AUTOMATION = "sparkdeploy: notify on an unhealthy deployment"
SUBJECT = "{{ event.payload.deployment }} is unhealthy: {{ event.payload.kind }}"
BODY = (
    "Deployment {{ event.payload.deployment }} ({{ event.payload.recipe }} on cluster"
    " {{ event.payload.cluster }}, nodes {{ event.payload.nodes | join(', ') }}) is unhealthy.\n"
    "Node: {{ event.payload.node }}\n"
    "Cause ({{ event.payload.kind }}): {{ event.payload.cause }}\n"
    "Endpoint: {{ event.payload.endpoint }}\n"
    "Seen by the watchdog at {{ event.occurred }}."
)


def notify_automation(block_document_id: UUID) -> AutomationCore:
    """Every unhealthy event of every deployment, to the given notification block."""
    return AutomationCore(
        name=NOTIFY_AUTOMATION,
        description="The smoke watchdog's unhealthy events, with their named cause, to a person.",
        trigger=EventTrigger(
            expect={UNHEALTHY},
            match={"prefect.resource.id": f"{RESOURCE_PREFIX}*"},
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[SendNotification(block_document_id=block_document_id, subject=SUBJECT, body=BODY)],
    )


def apply_notify_automation(client: SyncPrefectClient, block: str) -> UUID:
    """The notification automation created or updated for `block` (BLOCK_TYPE/BLOCK_NAME, as
    `prefect block ls` lists it); its id."""
    block_type, _, name = block.partition("/")
    if not block_type or not name:
        raise SparkDeployError(
            f"notification block {block!r}: give it as BLOCK_TYPE/BLOCK_NAME, e.g."
            " slack-webhook/ops (`prefect block ls` lists them)"
        )
    try:
        document = client.read_block_document_by_name(name, block_type, include_secrets=False)
    except ObjectNotFound as error:
        raise SparkDeployError(
            f"notification block {block!r} is not on the Prefect server ({error}); create it"
            " first (`prefect block ls` lists those there)"
        ) from error
    automation = notify_automation(document.id)
    existing = client.read_automations_by_name(NOTIFY_AUTOMATION)
    if existing:
        client.update_automation(existing[0].id, automation)
        return existing[0].id
    return client.create_automation(automation)
