"""Prefect task: the node-local files of every node, the Engram sparse copies and the plain files
(logic in sparkdeploy.steps.stage_engram and sparkdeploy.steps.stage_plain)."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.errors import TransientRemoteError
from sparkdeploy.node.engram_copy import StagingResult
from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.stage_engram import stage_engram
from sparkdeploy.steps.stage_plain import stage_plain
from sparkdeploy.units import human_bytes
from tasks.artifacts import publish_table
from tasks.common import artifact_key, retried_on


@task(
    name="stage-engram",
    **retried_on(TransientRemoteError, 10, 30, 120),
)
def stage_engram_on_nodes(plan: Plan) -> dict[str, list[StagingResult]]:
    """Every plain local file of every node's plan put whole (or found or adopted) and verified
    by sha256, all nodes at once (first: they are small); then every Engram shard copied (or
    found, adopted, or finished) and verified, all nodes at once. Returns the Engram copies.

    One python3 per node checks and copies its shards, its progress logged as it comes. One task
    run for all nodes, not one per node: each task run costs the Prefect server and the flow a
    few API calls, which a warm redeploy of many nodes felt. A retried run finds the nodes that
    finished and resumes an interrupted copy where its journal says it stopped.
    """
    logger = get_run_logger()
    for decided in plan.local_files:
        logger.info("local file %s: %s (%s)", decided.dest, decided.kind, decided.why)
    staged = [node for node in plan.nodes if node.engram]
    rows = _plain_files(plan)
    if not staged:
        logger.info("the plan stages no Engram shards")
        _publish(plan, rows)
        return {}

    def log_progress(node_name: str, dest: str, done: int, total: int, phase: str) -> None:
        logger.info(
            "node %s: %s: %s of %s %s",
            node_name,
            dest,
            human_bytes(done),
            human_bytes(total),
            "compared with the NAS shard (to adopt the file there)"
            if phase == "compare"
            else "copied and verified",
        )

    for node in staged:
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

    by_node = stage_engram(plan, on_progress=log_progress)
    for results in by_node.values():
        for result in results:
            logger.info(
                "node %s: %s: %s, share %s, wrote %s, allocated %s, %.1f s",
                result.node,
                result.dest,
                result.status,
                human_bytes(result.share_bytes),
                human_bytes(result.copied_bytes),
                human_bytes(result.allocated_bytes),
                result.seconds,
            )
            if result.note is not None:
                logger.warning("node %s: %s: %s", result.node, result.dest, result.note)
            rows.append(
                {
                    "node": result.node,
                    "file": result.dest,
                    "status": result.status,
                    "ranks": ",".join(map(str, result.ranks)),
                    "tp": result.tp_size,
                    "share": human_bytes(result.share_bytes),
                    "written": human_bytes(result.copied_bytes),
                    "allocated": human_bytes(result.allocated_bytes),
                    "seconds": result.seconds,
                }
            )
    _publish(plan, rows)
    return by_node


def _plain_files(plan: Plan) -> list[dict[str, object]]:
    """Every node's plain local files in place; their rows of the step's table."""
    if not any(node.plain for node in plan.nodes):
        return []
    logger = get_run_logger()
    rows: list[dict[str, object]] = []
    for results in stage_plain(plan).values():
        for result in results:
            logger.info(
                "node %s: %s: plain file %s, sha256 %s, wrote %s, %.1f s",
                result.node,
                result.dest,
                result.status,
                result.sha256[:12],
                human_bytes(result.written_bytes),
                result.seconds,
            )
            rows.append(
                {
                    "node": result.node,
                    "file": result.dest,
                    "status": result.status,
                    "ranks": "whole file",
                    "tp": "",
                    "share": human_bytes(result.size),
                    "written": human_bytes(result.written_bytes),
                    "allocated": "",
                    "seconds": result.seconds,
                }
            )
    return rows


def _publish(plan: Plan, rows: list[dict[str, object]]) -> None:
    if rows:
        publish_table(
            key=artifact_key("stage-engram", plan.deployment_id),
            table=rows,
            description=f"node-local files (Engram sparse copies, plain files) on the nodes of "
            f"{plan.deployment_id}",
        )
