"""The `status` flow: what runs on each node of a cluster; per deployment its health, healthy
since, the sentinel's last probe, its last fault, repairs this hour, last smoke test and bytes on
each node (a `status-<cluster>` markdown artifact)."""

from __future__ import annotations

from prefect import flow

from sparkdeploy.steps.status import DeploymentStatus
from tasks.artifacts import artifacts_written
from tasks.status import read_cluster_status


@flow(
    name="status",
    flow_run_name="status of {cluster}",
    # Its result holds the plans, with their secrets: never persisted (tasks/common.py).
    persist_result=False,
    on_completion=[artifacts_written],
    on_failure=[artifacts_written],
)
def status(cluster: str) -> list[DeploymentStatus]:
    return read_cluster_status(cluster)
