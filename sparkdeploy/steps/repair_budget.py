"""Automated repairs, bounded: the watchdog's automation redeploys an unhealthy deployment at
most a set number of times an hour, then leaves it to a person.

Prefect's automations fire on every matching event and have no cool-down of their own
(docs/field.md#prefect-transactions-events-automations), so the bound is kept by the repair
runs themselves: a repair run counts the earlier repair runs of the same deployment that started
within the past hour (their flow runs carry the `repair` tag) and is refused once the bound is
reached. Two events of one failure start two repairs; the second waits for the nodes, finds
the deployment serving again and gives its tag back (`repair-not-needed`): it did nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

REPAIR_TAG = "repair"
# A repair that found the deployment already redeployed (by a repair of an earlier event) and
# did nothing: it does not count.
REPAIR_NOT_NEEDED_TAG = "repair-not-needed"
WINDOW = timedelta(hours=1)


def deployment_tag(deployment_id: str) -> str:
    """The tag every flow run of a deployment carries (tasks/runlabels.py): with REPAIR_TAG, it
    finds the deployment's repairs."""
    return f"deployment:{deployment_id}"


@dataclass(frozen=True)
class EarlierRepair:
    flow_run_name: str
    started: datetime


def repair_refusal(
    deployment_id: str,
    cause: str,
    earlier: Sequence[EarlierRepair],
    *,
    per_hour: int,
    now: datetime,
) -> str | None:
    """Why this repair is refused (None: it may go ahead): `per_hour` repairs of the deployment
    already started within the past hour."""
    recent = sorted(
        (repair for repair in earlier if now - repair.started < WINDOW),
        key=lambda repair: repair.started,
    )
    if len(recent) < per_hour:
        return None
    listed = ", ".join(
        f"{repair.flow_run_name} at {repair.started.isoformat(timespec='seconds')}"
        for repair in recent
    )
    return (
        f"{deployment_id} is unhealthy again ({cause}) but was repaired {len(recent)} time(s) in"
        f" the past hour ({listed}), the most the automation may ({per_hour} an hour): it is"
        " left for a person. Look at the watchdog's diagnosis and the container logs on the NAS,"
        " fix the cause, then deploy it (or wait an hour for the automation to try again)"
    )
