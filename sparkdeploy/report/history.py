"""What Prefect remembers of each deployment, for the status view: its last smoke test (the
smoke-test task's table artifact, `smoke-<deployment>`), its last fault and when it recovered
(the watchdog's and the sentinel's health events, sparkdeploy.spec.events), its repairs in the
past hour (the deploy runs the repair automation started: they carry a repair tag), and the
sentinel's last probe of it (the record the sentinel keeps in a Prefect Variable per cluster,
sparkdeploy.steps.sentinel_record). Each is read in one request for every deployment at once;
only the recovery after a fault takes one per deployment that had one, and the sentinel's
schedule is asked for only when its record does not answer.

The texts say plainly what is not known ("none recorded", "no probe yet: ..."): a status cell is
never blank.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    ArtifactCollectionFilter,
    ArtifactCollectionFilterKey,
    FlowRunFilter,
    FlowRunFilterStartTime,
    FlowRunFilterTags,
)
from prefect.events.filters import (
    EventFilter,
    EventNameFilter,
    EventOccurredFilter,
    EventOrder,
    EventResourceFilter,
)
from prefect.exceptions import ObjectNotFound

from sparkdeploy.spec.events import HEALTHY, UNHEALTHY, resource_id
from sparkdeploy.units import ago

NONE_YET = "none yet"
# The sentinel writes its record at least every 30 s while it runs, and the next run starts
# within a minute of the last one's end: a record older than this is of a sentinel that stopped.
RECORD_STALE_AFTER = timedelta(seconds=90)


def artifact_key(prefix: str, name: str) -> str:
    """The key a task stores an artifact under. Prefect artifact keys allow lowercase letters,
    digits and dashes only."""
    return f"{prefix}-" + re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")


def sentinel_variable(cluster: str) -> str:
    """The name of the sentinel's record of a cluster (Variable names allow lowercase letters,
    digits, dashes and underscores: the artifact keys' rule fits)."""
    return artifact_key("sentinel", cluster)


def stamp(moment: datetime, now: datetime) -> str:
    """`12 min ago (2026-01-01 09:31 UTC)`."""
    return f"{ago(moment, now)} ({moment:%Y-%m-%d %H:%M} UTC)"


# --- the sentinel's record --------------------------------------------------------------------


@dataclass(frozen=True)
class LastProbe:
    """The sentinel's last probe of one deployment, as its record keeps it."""

    at: datetime
    outcome: str  # ok, failed, unreachable (sparkdeploy.steps.sentinel.Outcome)
    state: str  # healthy, suspect, unhealthy (sparkdeploy.steps.sentinel.Liveness)
    node: str = ""
    kind: str = ""
    cause: str = ""

    def as_json(self) -> dict[str, str]:
        fault = {"node": self.node, "kind": self.kind, "cause": self.cause}
        return {
            "at": self.at.isoformat(),
            "outcome": self.outcome,
            "state": self.state,
            **(fault if self.outcome != "ok" else {}),
        }

    def text(self, now: datetime) -> str:
        if self.outcome == "ok" and self.state == "healthy":
            return f"ok, {ago(self.at, now)}"
        fault = f": {self.kind} on {self.node}: {self.cause}" if self.outcome != "ok" else ""
        return f"{self.outcome} ({self.state}){fault}, {ago(self.at, now)}"


@dataclass(frozen=True)
class SentinelRecord:
    """What the sentinel of a cluster last wrote: when, and each watched deployment's probe."""

    written: datetime
    probes: dict[str, LastProbe]

    def as_json(self) -> dict[str, Any]:
        return {
            "written": self.written.isoformat(),
            "deployments": {dep: probe.as_json() for dep, probe in self.probes.items()},
        }

    @classmethod
    def from_json(cls, value: Any) -> SentinelRecord | None:
        """The record a Variable holds; None for anything else."""
        try:
            return cls(
                written=datetime.fromisoformat(value["written"]),
                probes={
                    str(dep): LastProbe(
                        at=datetime.fromisoformat(entry["at"]),
                        outcome=str(entry["outcome"]),
                        state=str(entry["state"]),
                        node=str(entry.get("node", "")),
                        kind=str(entry.get("kind", "")),
                        cause=str(entry.get("cause", "")),
                    )
                    for dep, entry in value["deployments"].items()
                },
            )
        except (TypeError, KeyError, ValueError, AttributeError):
            return None


@dataclass(frozen=True)
class Sentinel:
    """The sentinel's record of the cluster (None: none yet) and, when the record does not
    answer, why no sentinel probes (its deployment's schedule)."""

    record: SentinelRecord | None
    why_not: str = ""

    def stale(self, now: datetime) -> bool:
        return self.record is None or now - self.record.written > RECORD_STALE_AFTER

    def probe_text(self, deployment_id: str, now: datetime) -> str:
        probe = self.record.probes.get(deployment_id) if self.record else None
        if not self.stale(now):
            if probe is None:
                return "not probed yet: the sentinel picks a new deployment up within 30 s"
            return probe.text(now)
        if probe is None or self.record is None:
            return f"no probe yet: {self.why_not}"
        return f"{probe.text(now)}; none since, {self.why_not}"


def schedule_text(client: SyncPrefectClient, cluster: str) -> str:
    """Why no sentinel probes the cluster, as its deployment (`sentinel/<cluster>`) says."""
    name = f"sentinel/{cluster}"
    try:
        deployment = client.read_deployment_by_name(name)
    except ObjectNotFound:
        return f"no {name} deployment is registered (prefect deploy --all)"
    if deployment.paused or not any(schedule.active for schedule in deployment.schedules):
        return f"the {name} schedule is off"
    return f"the {name} schedule is on but none of its runs is probing (is a worker running?)"


def read_sentinel(client: SyncPrefectClient, cluster: str, now: datetime) -> Sentinel:
    """The sentinel's record of the cluster in one request; its schedule in one more when the
    record is missing or stale."""
    variable = client.read_variable_by_name(sentinel_variable(cluster))
    found = Sentinel(SentinelRecord.from_json(variable.value) if variable else None)
    if not found.stale(now):
        return found
    return Sentinel(found.record, schedule_text(client, cluster))


# --- health events, repairs, smoke tests ------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """A deployment's last unhealthy event."""

    occurred: datetime
    node: str
    kind: str
    cause: str

    def text(self, now: datetime) -> str:
        return f"{self.kind} on {self.node}, {ago(self.occurred, now)}: {self.cause}"


@dataclass(frozen=True)
class History:
    last_smoke: str
    fault: Fault | None  # the last unhealthy event
    recovered: datetime | None  # the first healthy event after it
    repairs: tuple[datetime, ...]  # the repair runs started in the past hour, newest first

    def fault_text(self, now: datetime) -> str:
        return self.fault.text(now) if self.fault else "none recorded"

    def repairs_text(self, now: datetime) -> str:
        if not self.repairs:
            return "none"
        return f"{len(self.repairs)}: " + ", ".join(ago(when, now) for when in self.repairs)

    def healthy_since_text(self, healthy: bool, started: datetime | None, now: datetime) -> str:
        """Since when the deployment has served well: since the healthy event that ended its
        last fault, or since its containers started when no fault came after that; `started` is
        its last container's start (the deployment whole from then on), None when not known."""
        fault = self.fault
        fault_since_start = fault is not None and (started is None or fault.occurred > started)
        if not healthy:
            if fault is not None and fault_since_start and self.recovered is None:
                return f"not healthy: unhealthy since {stamp(fault.occurred, now)} ({fault.kind})"
            return "not healthy now"
        if fault is not None and fault_since_start:
            if self.recovered is not None:
                return f"{stamp(self.recovered, now)}, recovered from its last fault"
            return (
                f"unknown: it serves now, but no healthy event came after its fault of"
                f" {ago(fault.occurred, now)}"
            )
        if started is None:
            return "unknown: its containers' start time is not known"
        return f"{stamp(started, now)}, its start: no fault since"


class HealthEvent(Protocol):
    """The fields of a Prefect event (prefect.events.schemas.events.ReceivedEvent) read here."""

    @property
    def event(self) -> str: ...
    @property
    def occurred(self) -> datetime: ...
    @property
    def payload(self) -> dict[str, Any]: ...


class TaggedRun(Protocol):
    """The fields of a Prefect flow run (prefect.client.schemas.objects.FlowRun) read here."""

    @property
    def tags(self) -> list[str]: ...
    @property
    def start_time(self) -> datetime | None: ...


def smoke_text(description: str | None, created: datetime | None, now: datetime) -> str:
    """`passed 3 min ago` / `FAILED 2 check(s) 1 h ago` from the smoke artifact's description."""
    if description is None or created is None:
        return NONE_YET
    _, _, outcome = description.rpartition(": ")
    verdict = "passed" if outcome == "every check passed" else f"FAILED ({outcome})"
    return f"{verdict}, {ago(created, now)}"


def fault_of(event: HealthEvent) -> Fault:
    payload = event.payload
    return Fault(
        occurred=event.occurred,
        node=str(payload.get("node") or "?"),
        kind=str(payload.get("kind") or "?"),
        cause=str(payload.get("cause") or "no cause given"),
    )


def repairs_by_deployment(
    runs: Iterable[TaggedRun], repair_tags: Mapping[str, Sequence[str]], since: datetime
) -> dict[str, tuple[datetime, ...]]:
    """Each deployment's repair runs started since `since`, newest first: the runs carrying
    every tag of its repair_tags."""
    found: dict[str, list[datetime]] = {dep: [] for dep in repair_tags}
    for run in runs:
        if run.start_time is None or run.start_time < since:
            continue
        for dep, tags in repair_tags.items():
            if set(tags) <= set(run.tags):
                found[dep].append(run.start_time)
    return {dep: tuple(sorted(starts, reverse=True)) for dep, starts in found.items()}


def _read_smokes(
    client: SyncPrefectClient, deployment_ids: Sequence[str], now: datetime
) -> dict[str, str]:
    keys = {artifact_key("smoke-test", dep): dep for dep in deployment_ids}
    return {
        keys[str(artifact.key)]: smoke_text(artifact.description, artifact.created, now)
        for artifact in client.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(
                key=ArtifactCollectionFilterKey(any_=list(keys))
            )
        )
        if artifact.key in keys
    }


def _read_faults(client: SyncPrefectClient, deployment_ids: Sequence[str]) -> dict[str, Fault]:
    """Each deployment's last unhealthy event, in one request (one event per resource)."""
    by_resource = {resource_id(dep): dep for dep in deployment_ids}
    page = client.read_events(
        EventFilter(
            event=EventNameFilter(name=[UNHEALTHY]),
            resource=EventResourceFilter(id=list(by_resource), distinct=True),
        ),
        limit=len(deployment_ids),
    )
    faults: dict[str, Fault] = {}
    for event in page.events:
        dep = by_resource.get(event.resource.id)
        if dep is not None and dep not in faults:
            faults[dep] = fault_of(event)
    return faults


def _read_recovery(client: SyncPrefectClient, deployment_id: str, fault: Fault) -> datetime | None:
    """The first healthy event of the deployment after its fault."""
    page = client.read_events(
        EventFilter(
            event=EventNameFilter(name=[HEALTHY]),
            resource=EventResourceFilter(id=[resource_id(deployment_id)]),
            occurred=EventOccurredFilter(since=fault.occurred + timedelta(microseconds=1)),
            order=EventOrder.ASC,
        ),
        limit=1,
    )
    return page.events[0].occurred if page.events else None


def read_history(
    client: SyncPrefectClient,
    deployment_ids: Sequence[str],
    now: datetime,
    *,
    repair_tags: Mapping[str, Sequence[str]],
    repair_window: timedelta,
) -> dict[str, History]:
    """Each deployment's last smoke test, last fault and recovery, and repairs within
    repair_window: the tags each deployment's repair runs carry are `repair_tags[deployment]`
    (sparkdeploy.steps.repair_budget says which)."""
    if not deployment_ids:
        return {}
    smokes = _read_smokes(client, deployment_ids, now)
    faults = _read_faults(client, deployment_ids)
    recovered = {dep: _read_recovery(client, dep, fault) for dep, fault in faults.items()}
    since = now - repair_window
    common = set.intersection(*(set(tags) for tags in repair_tags.values()))
    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=sorted(common)),
            start_time=FlowRunFilterStartTime(after_=since),
        )
    )
    repairs = repairs_by_deployment(runs, repair_tags, since)
    return {
        dep: History(
            last_smoke=smokes.get(dep, NONE_YET),
            fault=faults.get(dep),
            recovered=recovered.get(dep),
            repairs=repairs.get(dep, ()),
        )
        for dep in deployment_ids
    }
