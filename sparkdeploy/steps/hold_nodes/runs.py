"""Which flow run this is, and which have ended, by Prefect's word: a holder whose run has ended
may be taken over (decisions.py), a wait ticket whose run has ended is passed over (queue.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Set as AbstractSet
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from sparkdeploy.remote.prefect_api import single_attempt_client
from sparkdeploy.steps.hold_nodes.api import _api


def _current_flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    run_id = flow_run.id
    return str(run_id) if run_id else None


def ended_runs(run_ids: AbstractSet[str | None]) -> set[str | None]:
    """Those of the flow runs that are not running: final, gone, or None (no run)."""
    with single_attempt_client() as client:
        return _ended_runs(client, run_ids)


def _ended_runs(client: SyncPrefectClient, run_ids: AbstractSet[str | None]) -> set[str | None]:
    """Those of the flow runs that are not running: final, gone, or None (no run), in one
    request."""
    ids = {}
    for run_id in run_ids:
        with contextlib.suppress(ValueError, TypeError):
            ids[UUID(str(run_id))] = run_id
    if not ids:
        return set(run_ids)
    runs = _api(
        client.read_flow_runs,
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(ids))),
        limit=len(ids),
    )
    live = {str(run.id) for run in runs if run.state is not None and not run.state.is_final()}
    return {run_id for run_id in run_ids if run_id not in live}
