"""Slots of Prefect global concurrency limits (limit 1 each): a node's lock, and the takeover
mutex. Taken all or none, the limits created on demand; given back with how long they were
held."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from uuid import UUID

import httpx
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.exceptions import ObjectAlreadyExists

from sparkdeploy.errors import NodeLockError
from sparkdeploy.steps.hold_nodes.api import _api
from sparkdeploy.steps.hold_nodes.records import limit_name

_HTTP_LOCKED = 423
# Prefect refuses to release slots held for 0 s.
_MIN_OCCUPANCY_S = 0.001


def _increment(
    client: SyncPrefectClient, names: Sequence[str], *, lease_s: float | None = None
) -> httpx.Response | None:
    """One slot of every named limit, all or none, creating the limits that do not exist yet,
    leased for lease_s when given; Prefect's answer, or None when one of them is full."""
    for _ in range(2):
        try:
            if lease_s is None:
                response = _api(
                    client.increment_concurrency_slots,
                    names=list(names),
                    slots=1,
                    mode="concurrency",
                )
            else:
                response = _api(
                    client.increment_concurrency_slots_with_lease,
                    names=list(names),
                    slots=1,
                    mode="concurrency",
                    lease_duration=lease_s,
                )
        except httpx.HTTPStatusError as error:
            if error.response.status_code != _HTTP_LOCKED:
                raise
            return None
        # The server skips names without a limit and takes the slots of the others.
        answer = response.json()
        limits = answer if lease_s is None else answer["limits"]
        taken = {str(limit["name"]) for limit in limits}
        missing = [name for name in names if name not in taken]
        if not missing:
            return response
        if lease_s is not None:
            _api(client.release_concurrency_slots_with_lease, UUID(answer["lease_id"]))
        elif taken:
            _api(
                client.release_concurrency_slots,
                names=sorted(taken),
                slots=1,
                occupancy_seconds=_MIN_OCCUPANCY_S,
            )
        for name in missing:
            # ObjectAlreadyExists: another deploy created it a moment ago.
            with contextlib.suppress(ObjectAlreadyExists):
                _api(
                    client.create_global_concurrency_limit,
                    GlobalConcurrencyLimitCreate(name=name, limit=1),
                )
    raise NodeLockError(f"the limits {', '.join(names)} vanish as soon as they are created")


def _take_slots(client: SyncPrefectClient, machines: Mapping[str, str]) -> bool:
    """One slot of every node's machine's limit, all or none; False when one of them is full."""
    return _increment(client, [limit_name(machine) for machine in machines.values()]) is not None


def _held_seconds(since_iso: str) -> float:
    try:
        since = datetime.fromisoformat(since_iso)
    except ValueError:
        return _MIN_OCCUPANCY_S
    return max(_MIN_OCCUPANCY_S, (datetime.now(UTC) - since).total_seconds())


def _give_back_slots(client: SyncPrefectClient, machines: Sequence[str], since_iso: str) -> None:
    """One slot of each machine's limit back, held since since_iso (ISO 8601)."""
    _api(
        client.release_concurrency_slots,
        names=[limit_name(machine) for machine in machines],
        slots=1,
        occupancy_seconds=_held_seconds(since_iso),
    )
