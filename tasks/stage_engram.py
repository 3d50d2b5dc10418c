"""Prefect task: the Engram sparse copies of one node (logic in sparkdeploy.staging)."""

from __future__ import annotations

import re
from typing import Any

from prefect import Task, task
from prefect.artifacts import create_table_artifact
from prefect.client.schemas.objects import TaskRun
from prefect.logging import get_run_logger
from prefect.states import State

from sparkdeploy.errors import TransientRemoteError
from sparkdeploy.plan import NodePlan
from sparkdeploy.ssh import SshTarget, connect
from sparkdeploy.staging import EngramShard, StagingResult, stage_engram_shards

GB = 1e9


def only_transient_remote(task: Task[Any, Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Retry a connection reset or timeout; never a missing source, a full disk or a bad copy."""
    try:
        state.result()
    except TransientRemoteError:
        return True
    except Exception:
        return False
    return False


def ssh_target(node: NodePlan) -> SshTarget:
    return SshTarget(**node.ssh.model_dump())


def artifact_key(prefix: str, node: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return f"{prefix}-" + re.sub(r"[^a-z0-9-]+", "-", node.lower()).strip("-")


@task(
    name="stage-engram",
    retries=3,
    retry_delay_seconds=[10, 30, 120],
    retry_condition_fn=only_transient_remote,
)
def stage_engram_on_node(node: NodePlan, nas_hf_cache: str) -> list[StagingResult]:
    """Every Engram shard of the node's plan copied (or found, or finished) and verified.

    One python3 on the node checks and copies them all, its progress logged as it comes. A
    retried run resumes an interrupted copy where its journal says it stopped.
    """
    logger = get_run_logger()
    if not node.engram:
        logger.info("node %s: no Engram shards to stage", node.node)
        return []

    def log_progress(node_name: str, dest: str, done: int, total: int) -> None:
        logger.info(
            "node %s: %s: %.2f of %.2f GB copied and verified",
            node_name,
            dest,
            done / GB,
            total / GB,
        )

    for stage in node.engram:
        logger.info(
            "node %s: staging %s/%s ranks %s of TP %d to %s",
            node.node,
            stage.repo.repo,
            stage.filename,
            stage.ranks,
            stage.tp_size,
            stage.dest,
        )
    shards = [
        EngramShard(
            repo=stage.repo.repo,
            revision=stage.repo.revision,
            filename=stage.filename,
            dest=stage.dest,
            ranks=tuple(stage.ranks),
            tp_size=stage.tp_size,
        )
        for stage in node.engram
    ]
    with connect(ssh_target(node)) as connection:
        results = stage_engram_shards(
            connection,
            node.node,
            nas_hf_cache=nas_hf_cache,
            shards=shards,
            on_progress=log_progress,
        )
    for result in results:
        logger.info(
            "node %s: %s: %s, share %.2f GB, wrote %.2f GB, allocated %.2f GB, %.1f s",
            node.node,
            result.dest,
            result.status,
            result.share_bytes / GB,
            result.copied_bytes / GB,
            result.allocated_bytes / GB,
            result.seconds,
        )
    create_table_artifact(
        key=artifact_key("engram-staging", node.node),
        table=[
            {
                "node": r.node,
                "file": r.dest,
                "status": r.status,
                "ranks": ",".join(map(str, r.ranks)),
                "tp": r.tp_size,
                "share_gb": round(r.share_bytes / GB, 3),
                "written_gb": round(r.copied_bytes / GB, 3),
                "allocated_gb": round(r.allocated_bytes / GB, 3),
                "seconds": r.seconds,
            }
            for r in results
        ],
        description=f"Engram sparse copies on {node.node}",
    )
    return results
