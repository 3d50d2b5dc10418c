"""Prefect task: the Engram sparse copies of one node (logic in sparkdeploy.staging)."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger

from sparkdeploy.errors import TransientRemoteError
from sparkdeploy.plan import NodePlan
from sparkdeploy.ssh import cached_connection
from sparkdeploy.staging import EngramShard, StagingResult, stage_engram_shards
from sparkdeploy.targets import node_target
from sparkdeploy.units import human_bytes
from tasks.common import artifact_key, retry_only


@task(
    name="stage-engram",
    retries=3,
    retry_delay_seconds=[10, 30, 120],
    retry_condition_fn=retry_only(TransientRemoteError),
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
            "node %s: %s: %s of %s copied and verified",
            node_name,
            dest,
            human_bytes(done),
            human_bytes(total),
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
    results = stage_engram_shards(
        cached_connection(node_target(node)),
        node.node,
        nas_hf_cache=nas_hf_cache,
        shards=shards,
        on_progress=log_progress,
    )
    for result in results:
        logger.info(
            "node %s: %s: %s, share %s, wrote %s, allocated %s, %.1f s",
            node.node,
            result.dest,
            result.status,
            human_bytes(result.share_bytes),
            human_bytes(result.copied_bytes),
            human_bytes(result.allocated_bytes),
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
                "share": human_bytes(r.share_bytes),
                "written": human_bytes(r.copied_bytes),
                "allocated": human_bytes(r.allocated_bytes),
                "seconds": r.seconds,
            }
            for r in results
        ],
        description=f"Engram sparse copies on {node.node}",
    )
    return results
