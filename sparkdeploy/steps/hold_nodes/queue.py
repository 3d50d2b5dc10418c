"""The wait queue: a deploy that must wait records a ticket, and takes free machines only when
no live ticket created before its own wants one of them (arrival order, in the package
docstring)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from uuid import uuid4

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.actions import VariableCreate, VariableUpdate
from prefect.client.schemas.objects import Variable

from sparkdeploy.remote.prefect_api import filter_variables
from sparkdeploy.steps.hold_nodes.api import _VARIABLE_PAGE, _api
from sparkdeploy.steps.hold_nodes.runs import _ended_runs

WAIT_TAGS = ["sparkdeploy", "node-wait"]
# A wait ticket not refreshed for this long (its waiter polls every POLL_S of
# sparkdeploy.steps.hold_nodes.acquire) was left by a waiter that died.
TICKET_STALE_S = 60.0


@dataclass(frozen=True)
class WaitTicket:
    """A deploy waiting for machines, as its ticket records it."""

    name: str
    deployment_id: str
    flow_run_id: str | None
    machines: frozenset[str]
    created: datetime
    updated: datetime

    @classmethod
    def of(cls, variable: Variable) -> WaitTicket | None:
        value = variable.value
        if not isinstance(value, dict) or not isinstance(value.get("machines"), list):
            return None
        if variable.created is None or variable.updated is None:
            return None
        return cls(
            name=variable.name,
            deployment_id=str(value.get("deployment_id")),
            flow_run_id=value.get("flow_run_id"),
            machines=frozenset(str(machine) for machine in value["machines"]),
            created=variable.created,
            updated=variable.updated,
        )

    def describe(self, machines: Mapping[str, str]) -> str:
        nodes = [node for node, machine in machines.items() if machine in self.machines]
        run = f", flow run {self.flow_run_id}" if self.flow_run_id else ""
        return (
            f"{', '.join(nodes)}: deployment {self.deployment_id}{run} has waited for"
            f" {'it' if len(nodes) == 1 else 'them'} since"
            f" {self.created.isoformat(timespec='seconds')} and goes first"
        )


def _wait_tickets(client: SyncPrefectClient) -> list[WaitTicket]:
    found: list[WaitTicket] = []
    while True:
        page = _api(
            filter_variables, client, tags=WAIT_TAGS, limit=_VARIABLE_PAGE, offset=len(found)
        )
        found += [ticket for ticket in map(WaitTicket.of, page) if ticket is not None]
        if len(page) < _VARIABLE_PAGE:
            return found


def _queue(
    client: SyncPrefectClient,
    ticket: str | None,
    deployment_id: str,
    flow_run_id: str | None,
    machines: Mapping[str, str],
) -> str:
    """This deploy's ticket for `machines`, created or refreshed (which moves its updated
    time, not its place); its name."""
    value = {
        "deployment_id": deployment_id,
        "flow_run_id": flow_run_id,
        "machines": sorted(machines.values()),
        "refreshed": time.time(),
    }
    if ticket is None:
        ticket = f"node-wait-{uuid4().hex}"
        _api(client.create_variable, VariableCreate(name=ticket, value=value, tags=WAIT_TAGS))
    else:
        _api(client.update_variable, VariableUpdate(name=ticket, value=value, tags=WAIT_TAGS))
    return ticket


def _ahead(
    client: SyncPrefectClient, ticket: str | None, machines: Mapping[str, str]
) -> list[WaitTicket]:
    """The live tickets for any of `machines` that came before this deploy's own `ticket` (all
    of them when it has none yet)."""
    tickets = _wait_tickets(client)
    own = next((found for found in tickets if found.name == ticket), None)
    wanted = set(machines.values())
    others = [found for found in tickets if found.name != ticket and found.machines & wanted]
    if own is not None:
        others = [
            found
            for found in others
            if (found.created, found.name) < (own.created, own.name)
            and (own.updated - found.updated).total_seconds() <= TICKET_STALE_S
        ]
    if not others:
        return []
    ended = _ended_runs(client, {found.flow_run_id for found in others if found.flow_run_id})
    return [
        found for found in others if found.flow_run_id is None or found.flow_run_id not in ended
    ]
