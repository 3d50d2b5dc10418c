"""Start a plan's containers on its nodes: stale ones out, preflight, RDMA facts, then run.

`boot(plan)` in order:
1. preflight on every node at once (sparkdeploy.node.probe, one round trip each): docker up,
   the image present with one ID on all nodes, the mount sources (composed dir, NAS cache)
   present, GPUs visible when the plan asks for GPUs, no GPU process of an earlier run left,
   and the free memory vLLM wants at start (gpu-memory-utilization x the node's memory; on
   unified memory MemFree, the page cache dropped first when that is what stands in the way and
   the inventory allows it: docs/field.md#memory-fit). The same round trip lists our stale
   containers there (any container labelled sparkdeploy.deployment; docs/field.md: a worker
   that meets an old head hangs).
2. where there are stale containers, those of this deployment (a stale copy of itself) and
   those whose deployment no longer holds the node go (their logs saved like teardown saves
   them), and those nodes are probed again, since the memory the stale ones held is free now.
   A container of a deployment that holds the node is a ContainerStartError naming it; one whose
   labels are not of our form (sparkdeploy.spec.labels) is reported and left alone; others'
   containers are never touched. Every node's problems are then reported together.
3. "auto" HCAs / GID index resolved from the node's sysfs (unset, and logged, without RDMA).
4. containers started, once every old one is gone: the head and the workers (--headless) all
   at once (vLLM's mp backend: a headless worker retries its connection to the head until the
   head listens).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sparkdeploy.errors import ContainerStartError
from sparkdeploy.remote.docker_cli import (
    ContainerInfo,
    Log,
    docker,
    list_containers,
    on_nodes,
)
from sparkdeploy.remote.node_probe import probe
from sparkdeploy.remote.runner import Runner, stderr_text
from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.secrecy import redact
from sparkdeploy.spec.labels import DEPLOYMENT_LABEL, STARTED_BY_LABEL, label_problems
from sparkdeploy.spec.plan import NodePlan, Plan
from sparkdeploy.steps.teardown import RemovedContainer, remove_labelled
from sparkdeploy.units import GIB

RUN_TIMEOUT_S = 120.0
STALE_STOP_TIMEOUT_S = 10
# `docker run --env-file F "$@"` with the secret env, read from stdin, in F: a fresh 0600 file
# (mktemp) removed when the shell exits, whatever docker's exit. The values travel on the SSH
# channel's stdin and sit in no argv, where `ps` would show them to anyone on the node; docker
# reads the file client-side and sends the values to dockerd over its socket. Fixed text again.
_RUN_WITH_ENV_FILE = (
    'umask 077; f=$(mktemp) || exit 125; trap \'rm -f "$f"\' EXIT; trap "exit 129" HUP INT TERM;'
    ' cat >"$f" || exit 125; docker run --env-file "$f" "$@"'
)

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeCheck:
    """One node's preflight facts."""

    node: str
    docker_version: str
    image_id: str
    free_bytes: int  # MemFree on unified memory, else MemAvailable
    required_free_bytes: int
    page_cache_bytes: int
    gpus: int | None  # None when the plan asks for no GPUs
    detected_env: dict[str, str]  # NCCL_IB_HCA / NCCL_IB_GID_INDEX resolved from "auto"
    notes: list[str] = field(default_factory=list)
    page_cache_dropped: bool = False
    free_before_drop_bytes: int | None = None


@dataclass(frozen=True)
class BootedNode:
    node: str
    rank: int
    role: str
    container_id: str
    container_name: str
    started_at: float  # epoch seconds, when its `docker run` returned


@dataclass(frozen=True)
class BootResult:
    deployment_id: str
    started_at: float  # epoch seconds, just before the first `docker run`
    nodes: list[BootedNode]
    checks: dict[str, NodeCheck]
    stale_removed: list[RemovedContainer]

    @property
    def container_ids(self) -> dict[str, str]:
        return {booted.node: booted.container_id for booted in self.nodes}


def _mount_sources(node: NodePlan) -> list[str]:
    sources = [mount.source for mount in node.container.mounts]
    if node.composed is not None and node.composed.root not in sources:
        sources.append(node.composed.root)
    return sources


def _detected_env(node: NodePlan, rdma: dict[str, Any] | None, notes: list[str]) -> dict[str, str]:
    """NCCL_IB_HCA / NCCL_IB_GID_INDEX for the settings the inventory leaves to "auto"."""
    if rdma is None:
        return {}
    notes.extend(rdma["notes"])
    if not rdma["devices"]:
        return {}
    env = {}
    if node.roce_hcas == "auto":
        if rdma["hcas"]:
            env["NCCL_IB_HCA"] = ",".join(rdma["hcas"])
        else:
            notes.append("no active RoCE HCA: NCCL_IB_HCA left unset (NCCL picks or uses sockets)")
    if node.gid_index == "auto" and rdma["gid_index"] is not None:
        env["NCCL_IB_GID_INDEX"] = str(rdma["gid_index"])
    elif node.gid_index == "auto":
        notes.append("no RoCE v2 IPv4 GID: NCCL_IB_GID_INDEX left unset (NCCL's auto)")
    return env


def free_memory(node: NodePlan, answer: dict[str, Any]) -> int:
    """The free memory that counts: on unified memory the GPU driver counts the page cache as
    used (MemFree); elsewhere the kernel gives it back to a process that asks (MemAvailable)."""
    memory = answer["memory"]
    return int(memory["free"] if node.memory.unified else memory["available"])


def _memory_problems(plan: Plan, node: NodePlan, answer: dict[str, Any]) -> list[str]:
    memory = answer["memory"]
    required = plan.memory.required_free_bytes(node.memory)
    problems = []
    if "page_cache_error" in answer:
        problems.append(
            f"dropping the page cache failed ({answer['page_cache_error']}): the SSH user"
            " needs root for /proc/sys/vm/drop_caches, or set [docker] drop_page_cache = false"
        )
    free = free_memory(node, answer)
    if free >= required:
        return problems
    counted = "MemAvailable"
    if node.memory.unified:
        counted = "MemFree: the GPU counts the page cache as used"
    if answer["page_cache_dropped"]:
        fix = "the page cache was dropped and it is still short: stop what holds the memory"
    elif node.memory.unified and memory["page_cache"]:
        fix = (
            f"the page cache holds {memory['page_cache'] / GIB:.1f} GiB: set [docker]"
            " drop_page_cache = true in the inventory to drop it before boot, or stop what holds"
            " the memory"
        )
    else:
        fix = "stop what holds the memory"
    problems.append(
        f"{free / GIB:.1f} GiB free ({counted}) of {memory['total'] / GIB:.1f} GiB, but the"
        f" recipe needs {required / GIB:.1f} GiB free at start (--gpu-memory-utilization"
        f" {plan.memory.flags.gpu_memory_utilization:g} x {node.memory.total_bytes / GIB:g} GiB,"
        f" the inventory's memory_gib; vLLM would refuse to start): {fix}, or lower"
        " --gpu-memory-utilization"
    )
    return problems


def _gpu_process_problems(answer: dict[str, Any]) -> list[str]:
    return [
        f"GPU process {process['pid']} ({process['name']}) holds "
        + (f"{process['used_bytes'] / GIB:.1f} GiB" if process["used_bytes"] is not None else "GPU")
        + " memory: an engine of an earlier run still running? stop it (its container, or"
        f" `kill {process['pid']}` on the node) before deploying"
        for process in answer["gpu_processes"].get("processes", [])
    ]


def _node_problems(plan: Plan, node: NodePlan, answer: dict[str, Any]) -> list[str]:
    if "error" in answer["docker"]:
        return [f"docker does not answer ({answer['docker']['error']}): start dockerd there"]
    problems = []
    if answer["image"] is None:
        problems.append(
            f"image {node.container.image} is not there: run the image step first"
            " (sparkdeploy.steps.image.ensure_image)"
        )
    problems.extend(
        f"{path} does not exist (a mount source of the container): run the prefetch/compose"
        " steps, or check the inventory's nas and node_paths"
        for path in answer["missing_paths"]
    )
    if node.container.gpus and not answer["gpus"]:
        problems.append(
            "no GPU visible (`nvidia-smi -L` lists none or is missing): check the driver, or set"
            ' [docker] gpus = "" in the inventory for a cluster without GPUs'
        )
    return problems + _gpu_process_problems(answer) + _memory_problems(plan, node, answer)


def _probe_nodes(plan: Plan, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """node_probe's preflight answer from each of `names`, all at once."""
    by_name = {node.node: node for node in plan.nodes}
    targets = plan_targets(plan)

    def check(runner: Runner, name: str) -> dict[str, Any]:
        node = by_name[name]
        request = {
            "image": node.container.image,
            "paths": _mount_sources(node),
            # A writable mount is the engine's own dir (a compile cache, say): made when missing.
            "create": [m.source for m in node.container.mounts if not m.read_only],
            "gpus": bool(node.container.gpus),
            "fabric_ip": node.fabric_ip,
            "detect_rdma": node.roce_hcas == "auto" or node.gid_index == "auto",
            "unified_memory": node.memory.unified,
            "required_free_bytes": plan.memory.required_free_bytes(node.memory),
            "drop_page_cache": plan.drop_page_cache,
            "stale_label": DEPLOYMENT_LABEL,
        }
        return probe(runner, name, "preflight", request)

    return on_nodes({name: targets[name] for name in names}, check)


def _judge(plan: Plan, answers: Mapping[str, dict[str, Any]], *, log: Log) -> dict[str, NodeCheck]:
    """ContainerStartError listing every node's problems, else each node's facts (logged)."""
    by_name = {node.node: node for node in plan.nodes}
    problems = []
    checks = {}
    for name, answer in answers.items():
        node = by_name[name]
        node_problems = _node_problems(plan, node, answer)
        problems += [f"node {name}: {problem}" for problem in node_problems]
        if node_problems:
            continue
        notes: list[str] = []
        if not answer["gpu_processes"]["checked"]:
            notes.append(f"GPU processes not checked: {answer['gpu_processes']['reason']}")
        notes += [
            f"container {foreign['name']} (image {foreign['image']}) runs here and is not ours:"
            " left alone; the memory it holds is not this deployment's"
            for foreign in answer.get("foreign_containers", [])
        ]
        checks[name] = NodeCheck(
            node=name,
            docker_version=answer["docker"]["version"],
            image_id=answer["image"]["id"],
            free_bytes=free_memory(node, answer),
            required_free_bytes=plan.memory.required_free_bytes(node.memory),
            page_cache_bytes=answer["memory"]["page_cache"],
            gpus=answer["gpus"],
            detected_env=_detected_env(node, answer.get("rdma"), notes),
            notes=notes,
            page_cache_dropped=answer["page_cache_dropped"],
            free_before_drop_bytes=(
                free_memory(node, {"memory": answer["memory_before_drop"]})
                if answer["page_cache_dropped"]
                else None
            ),
        )
    image_ids = {check.image_id for check in checks.values()}
    if not problems and len(image_ids) > 1:
        listed = ", ".join(f"{name} has {check.image_id[:19]}" for name, check in checks.items())
        problems.append(
            f"{plan.nodes[0].container.image} differs between nodes ({listed}): mismatched"
            " images boot and hang; run the image step again"
        )
    if problems:
        raise ContainerStartError(
            f"deployment {plan.deployment_id}: preflight failed:\n" + "\n".join(problems)
        )
    for name, node_check in checks.items():
        detected = ", ".join(f"{k}={v}" for k, v in node_check.detected_env.items()) or "none"
        log(
            f"node {name}: docker {node_check.docker_version}, image {node_check.image_id[:19]},"
            f" {node_check.free_bytes / GIB:.1f} GiB free of the"
            f" {node_check.required_free_bytes / GIB:.1f} GiB needed, page cache"
            f" {node_check.page_cache_bytes / GIB:.1f} GiB"
            + (
                f" (dropped: {node_check.free_before_drop_bytes / GIB:.1f} GiB were free)"
                if node_check.free_before_drop_bytes is not None
                else ""
            )
            + (f", {node_check.gpus} GPUs" if node_check.gpus is not None else "")
            + f"; detected {detected}"
        )
        for note in node_check.notes:
            log(f"node {name}: {note}")
    return checks


def stop_stale(
    plan: Plan,
    nodes: Sequence[str],
    *,
    held_by: Mapping[str, str | None] | None = None,
    log: Log = _LOG.info,
) -> list[RemovedContainer]:
    """The stale sparkdeploy containers on these nodes of the plan removed, their logs saved in
    runs_dir: this deployment's and those of deployments that no longer hold the node.

    `held_by`: node -> the deployment its node lock names (sparkdeploy.steps.hold_nodes.holders);
    None when the caller holds every node for this deployment. A container of a deployment that
    holds its node is a ContainerStartError naming it, raised before anything is stopped.
    """
    targets = {name: plan_targets(plan)[name] for name in nodes}

    def live(node: str, container: ContainerInfo) -> bool:
        deployment = container.labels[DEPLOYMENT_LABEL]
        holder = held_by.get(node) if held_by is not None else plan.deployment_id
        return deployment != plan.deployment_id and deployment == holder

    found = on_nodes(targets, lambda runner, node: list_containers(runner, node, DEPLOYMENT_LABEL))
    blocking = [
        f"node {node}: container {container.name} of deployment"
        f" {container.labels[DEPLOYMENT_LABEL]}, which holds the node"
        for node, containers in found.items()
        for container in containers
        if not label_problems(container.labels, node) and live(node, container)
    ]
    if blocking:
        raise ContainerStartError(
            f"deployment {plan.deployment_id}: another live deployment is on its nodes:\n"
            + "\n".join(blocking)
            + "\ntear that deployment down (the teardown flow) or choose other nodes"
        )
    removed = remove_labelled(
        targets,
        DEPLOYMENT_LABEL,
        plan.runs_dir,
        stop_timeout_s=STALE_STOP_TIMEOUT_S,
        select=lambda node, container: not live(node, container),
        log=log,
    )
    for container in removed:
        log(
            f"node {container.node}: removed stale container {container.name}"
            f" (deployment {container.deployment_id}, {container.status}); log in"
            f" {container.log_path}"
        )
    return removed


def _run(
    runner: Runner,
    node: NodePlan,
    extra_env: Mapping[str, str],
    started_by: str | None = None,
) -> str:
    spec = node.container
    if extra_env:
        spec = spec.model_copy(update={"env": {**spec.env, **extra_env}})
    if started_by is not None:
        spec = spec.model_copy(update={"labels": {**spec.labels, STARTED_BY_LABEL: started_by}})
    argv = spec.docker_run_argv()
    if spec.secret_env:
        result = runner.run(
            ["sh", "-c", _RUN_WITH_ENV_FILE, "sh", *argv[2:]],
            timeout=RUN_TIMEOUT_S,
            stdin=spec.env_file(),
            check=False,
        )
    else:
        result = docker(runner, argv[1:], timeout=RUN_TIMEOUT_S)
    if result.exit_code != 0:
        raise ContainerStartError(
            f"node {node.node}: `docker run` of {spec.name} exited {result.exit_code}:"
            f" {redact(stderr_text(result), spec.secret_env.values())}; a name conflict means a"
            " container of that name that is not ours exists there: remove or rename it"
        )
    return result.stdout.decode().strip().splitlines()[-1]


def start_containers(
    plan: Plan,
    checks: Mapping[str, NodeCheck],
    *,
    started_by: str | None = None,
    log: Log = _LOG.info,
) -> list[BootedNode]:
    """The plan's containers started, all at once (module docstring), each labelled with
    `started_by` (the flow run starting them) when given."""
    targets = plan_targets(plan)

    def start(node: NodePlan, runner: Runner) -> BootedNode:
        container_id = _run(runner, node, checks[node.node].detected_env, started_by)
        log(f"node {node.node}: started {node.container.name} ({container_id[:12]}) as {node.role}")
        return BootedNode(
            node=node.node,
            rank=node.rank,
            role=node.role,
            container_id=container_id,
            container_name=node.container.name,
            started_at=time.time(),
        )

    by_name = {node.node: node for node in plan.nodes}
    together = {node.node: targets[node.node] for node in plan.nodes}
    started = on_nodes(together, lambda runner, name: start(by_name[name], runner))
    return [started[name] for name in together]


def boot(
    plan: Plan,
    *,
    held_by: Mapping[str, str | None] | None = None,
    started_by: str | None = None,
    log: Log = _LOG.info,
) -> BootResult:
    """Preflight with stale containers out, then the plan's containers started (module
    docstring).

    The caller holds the plan's node locks (sparkdeploy.steps.hold_nodes) for the deployment's life;
    `held_by` is what they say of each node (stop_stale). `started_by`: the flow run booting,
    recorded on its containers (labels.STARTED_BY_LABEL).
    """
    names = [node.node for node in plan.nodes]
    answers = _probe_nodes(plan, names)
    stale_nodes = [name for name in names if answers[name]["stale_containers"]]
    stale: list[RemovedContainer] = []
    if stale_nodes:
        stale = stop_stale(plan, stale_nodes, held_by=held_by, log=log)
        answers.update(_probe_nodes(plan, stale_nodes))
    checks = _judge(plan, answers, log=log)
    started_at = time.time()
    booted = start_containers(plan, checks, started_by=started_by, log=log)
    return BootResult(
        deployment_id=plan.deployment_id,
        started_at=started_at,
        nodes=booted,
        checks=checks,
        stale_removed=stale,
    )
