"""What Prefect remembers of each deployment: its last smoke test (the smoke-test task's table
artifact, `smoke-<deployment>`) and its last health event from the watchdog
(sparkdeploy.spec.events). The status view shows them beside what the nodes say.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey
from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

from sparkdeploy.spec.events import RESOURCE_PREFIX, resource_id
from sparkdeploy.units import ago

NONE_YET = "none yet"


@dataclass(frozen=True)
class History:
    last_smoke: str
    last_event: str


def smoke_text(description: str | None, created: datetime | None, now: datetime) -> str:
    """`passed 3 min ago` / `FAILED 2 check(s) 1 h ago` from the smoke artifact's description."""
    if description is None or created is None:
        return NONE_YET
    _, _, outcome = description.rpartition(": ")
    verdict = "passed" if outcome == "every check passed" else f"FAILED ({outcome})"
    return f"{verdict}, {ago(created, now)}"


def event_text(name: str, occurred: datetime, payload: dict[str, Any], now: datetime) -> str:
    """`unhealthy: node2 worker_died (...), 5 min ago` from a health event."""
    kind = name.removeprefix(RESOURCE_PREFIX)
    if kind == "healthy":
        return f"healthy, {ago(occurred, now)}"
    node, cause = payload.get("node"), payload.get("cause")
    return f"{kind}: {node} {payload.get('kind')} ({cause}), {ago(occurred, now)}"


def artifact_key(prefix: str, name: str) -> str:
    """The key a task stores an artifact under. Prefect artifact keys allow lowercase letters,
    digits and dashes only."""
    return f"{prefix}-" + re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")


def read_history(
    client: SyncPrefectClient, deployment_ids: Sequence[str], now: datetime
) -> dict[str, History]:
    """Each deployment's last smoke test and last health event, in two requests."""
    if not deployment_ids:
        return {}
    keys = {artifact_key("smoke-test", dep): dep for dep in deployment_ids}
    smokes = {
        keys[str(artifact.key)]: smoke_text(artifact.description, artifact.created, now)
        for artifact in client.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(
                key=ArtifactCollectionFilterKey(any_=list(keys))
            )
        )
        if artifact.key in keys
    }
    page = client.read_events(
        EventFilter(
            event=EventNameFilter(prefix=[RESOURCE_PREFIX]),
            resource=EventResourceFilter(
                id=[resource_id(dep) for dep in deployment_ids], distinct=True
            ),
        ),
        limit=len(deployment_ids),
    )
    by_resource = {resource_id(dep): dep for dep in deployment_ids}
    events: dict[str, str] = {}
    for event in page.events:
        dep = by_resource.get(event.resource.id)
        if dep is not None and dep not in events:
            events[dep] = event_text(event.event, event.occurred, event.payload, now)
    return {
        dep: History(smokes.get(dep, NONE_YET), events.get(dep, NONE_YET)) for dep in deployment_ids
    }
