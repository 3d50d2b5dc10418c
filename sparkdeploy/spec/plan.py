"""The launch plan: what a deployment does on each node, computed without touching any node.

`make_plan(recipe, cluster, nodes)` is pure: the same inputs give the same plan (and the same
deployment id), so a plan can be shown, diffed and tested before anything runs. Its only reads
are of inputs: a local file's kind from the NAS cache when this host sees it, and an ops host
local file's sha256 (sparkdeploy.spec.local_files). Every model here
is plain data (JSON-able, picklable) so Prefect tasks can pass it around.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import posixpath
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from sparkdeploy.errors import PlanError, RecipeError
from sparkdeploy.secrecy import Secret, keyed_digest
from sparkdeploy.spec.cluster import Cluster, GidIndex, Node, RoceHcas
from sparkdeploy.spec.container import LABEL_PREFIX, ContainerSpec, container_spec
from sparkdeploy.spec.local_files import Kind, local_file_kind
from sparkdeploy.spec.memory import EngineMemory, FitReport, NodeMemory, read_memory_flags
from sparkdeploy.spec.quality import Quality
from sparkdeploy.spec.recipe import MarkerSpec, Recipe, RepoRef, SmokeOptions
from sparkdeploy.units import GIB
from sparkdeploy.vllm.args import argv_has_flag
from sparkdeploy.vllm.markers import DEFAULT_BOOT_MARKERS, DEFAULT_FAILURE_MARKERS

AUTO_TOOL_CHOICE_FLAG = "--enable-auto-tool-choice"
REASONING_PARSER_FLAG = "--reasoning-parser"

__all__ = [
    "ComposedPlan",
    "EngramStage",
    "LocalFileKind",
    "MarkerSpec",
    "NodePlan",
    "PlainStage",
    "Plan",
    "RepoRef",
    "SmokeOptions",
    "SshSpec",
    "make_plan",
]

# The digest of what a node runs (spec_digest): a running copy started from another version of
# the recipe or inventory is told apart from one started from this plan.
SPEC_LABEL = f"{LABEL_PREFIX}spec"
# A keyed digest of the secret values a container was started with (with_secrets_label): the
# spec digest masks them, so without it a rotated secret would be found "already serving".
SECRETS_LABEL = f"{LABEL_PREFIX}secrets"


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngramStage(_Data):
    """A per-rank sparse copy of `filename` from `repo`'s snapshot, written to `dest`."""

    repo: RepoRef
    filename: str
    dest: str
    ranks: list[int]
    tp_size: int


class PlainStage(_Data):
    """`filename` put whole at `dest`: from `repo`'s snapshot in the NAS cache, or from
    `ops_file` on the flow host, whose sha256 and size are read at plan time (so a changed file
    changes the node's spec digest, and the node checks the bytes it gets against them)."""

    filename: str
    dest: str
    repo: RepoRef | None
    ops_file: str | None
    sha256: str | None
    size: int | None


class LocalFileKind(_Data):
    """What a local file is staged as, and the rule that decided (sparkdeploy.spec.local_files)."""

    dest: str
    kind: Kind
    why: str


class ComposedPlan(_Data):
    root: str  # the composed dir on the node
    sources: list[RepoRef]
    local_files: list[str]
    mount: str  # where the container sees `root`


class SshSpec(_Data):
    """The fields of sparkdeploy.remote.ssh.SshTarget (kept here so planning needs no paramiko)."""

    host: str
    port: int
    user: str
    identity_file: str
    known_hosts: str
    connect_timeout_s: float


class NodePlan(_Data):
    node: str
    rank: int
    role: Literal["head", "worker"]
    ssh: SshSpec
    fabric_ip: str
    fabric_netdev: str
    roce_hcas: RoceHcas
    gid_index: GidIndex
    tp_ranks: list[int]
    memory: NodeMemory
    container: ContainerSpec
    engram: list[EngramStage]
    plain: list[PlainStage] = Field(default_factory=list)
    composed: ComposedPlan | None

    @property
    def composed_root(self) -> str | None:
        """The node's composed HF cache dir; None when the plan composes none there."""
        return self.composed.root if self.composed is not None else None


class Plan(_Data):
    deployment_id: str
    recipe: str
    cluster: str
    served_model_name: str
    api_port: int
    endpoint: str
    api_key: Secret | None  # sent as `Authorization: Bearer` to /v1 when the recipe sets one
    readiness_timeout_s: float
    boot_markers: list[MarkerSpec]
    failure_markers: list[MarkerSpec]
    smoke: SmokeOptions
    repos: list[RepoRef]
    nas_hf_cache: str
    runs_dir: str
    hub_endpoint: str | None  # None: HF_ENDPOINT, else the public hub
    hub_allow_http_token: bool  # the inventory's [hub].allow_http_token
    # The recipe's [prefetch] patterns: repo paths beyond / out of what an engine reads.
    prefetch_include: list[str]
    prefetch_exclude: list[str]
    docker_image: str
    docker_image_dir: str | None  # built from images/<dir> when set, else pulled
    registry: str | None  # where built images travel from the builder to the other nodes
    drop_page_cache: bool
    blocked: str | None
    memory: EngineMemory
    nodes: list[NodePlan]
    # The fit check's figures (sparkdeploy.steps.fit), once the model is in the NAS cache.
    fit: FitReport | None = None
    local_files: list[LocalFileKind] = Field(default_factory=list)
    quality: Quality | None = None  # the recipe's [quality]: evals after the smoke test

    @property
    def head(self) -> NodePlan:
        """The node of rank 0: it serves the API; the others are its workers."""
        return next(node for node in self.nodes if node.role == "head")

    @property
    def workers(self) -> list[NodePlan]:
        return [node for node in self.nodes if node.role == "worker"]

    @property
    def head_serve_argv(self) -> list[str]:
        """The head's `vllm serve ...` argv: its container's entrypoint and command."""
        head = self.head
        return [*head.container.entrypoint, *head.container.command]

    @property
    def tool_calls_enabled(self) -> bool:
        """The engine picks tools on its own (--enable-auto-tool-choice): a tool call is asked."""
        return argv_has_flag(self.head_serve_argv, AUTO_TOOL_CHOICE_FLAG)

    @property
    def reasoning_enabled(self) -> bool:
        """The engine parses reasoning out of the answer (--reasoning-parser)."""
        return argv_has_flag(self.head_serve_argv, REASONING_PARSER_FLAG)


def ssh_spec(cluster: Cluster, node: Node) -> SshSpec:
    """How to reach an inventory node: its own SSH settings and the cluster's known_hosts."""
    return SshSpec(
        host=node.host,
        port=node.port,
        user=node.user,
        identity_file=node.identity_file,
        known_hosts=cluster.known_hosts,
        connect_timeout_s=node.connect_timeout_s,
    )


def deployment_id(recipe_id: str, node_names: Sequence[str]) -> str:
    """Readable and stable: the recipe plus a hash of recipe and nodes, in rank order."""
    digest = hashlib.sha256("\0".join([recipe_id, *node_names]).encode()).hexdigest()
    return f"{recipe_id[:40]}-{digest[:8]}"


def spec_digest(node: NodePlan) -> str:
    """What the node runs, as a digest: its container (image reference, argv, env, mounts, run
    options), its Engram copies and composed sources with their revisions.
    How the node is reached (ssh) and the labels are left out; secret values are masked (their
    keyed digest is a label of its own: with_secrets_label)."""
    data = node.model_dump(mode="json", exclude={"ssh": True, "container": {"labels"}})
    if not data["plain"]:
        # Left out when empty, so deployments without plain files keep the digest their running
        # containers carry from before plain files existed.
        del data["plain"]
    # Ray's head-only serve argv was a field (None on every mp node) until Ray was removed; kept
    # as it was, so the containers running keep the digest their labels carry.
    data["serve_exec"] = None
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _with_spec_label(node: NodePlan) -> NodePlan:
    labels = {**node.container.labels, SPEC_LABEL: spec_digest(node)}
    return node.model_copy(
        update={"container": node.container.model_copy(update={"labels": labels})}
    )


def with_secrets_label(plan: Plan, key: bytes) -> Plan:
    """The plan with each container that has secret env labelled SECRETS_LABEL with their keyed
    digest (secrecy.keyed_digest), so a copy started with other values is told apart. `key` is
    kept on the flow side (tasks.plan.secrets_digest_key), never on a node; make_plan stays
    pure, and `sparkdeploy plan`, which has no key, shows no such label."""
    nodes = []
    for node in plan.nodes:
        spec = node.container
        if spec.secret_env:
            labels = {**spec.labels, SECRETS_LABEL: keyed_digest(spec.secret_env, key)}
            node = node.model_copy(update={"container": spec.model_copy(update={"labels": labels})})
        nodes.append(node)
    return plan.model_copy(update={"nodes": nodes})


def _check_placement(recipe: Recipe, cluster: Cluster, nodes: list[Node]) -> int:
    """Ranks each node runs; raises PlanError when the nodes cannot hold the recipe."""
    world = recipe.tensor_parallel_size * recipe.pipeline_parallel_size
    if world % len(nodes):
        raise PlanError(
            f"recipe {recipe.recipe_id}: tensor_parallel_size × pipeline_parallel_size = {world} "
            f"cannot be split evenly over {len(nodes)} nodes"
        )
    per_node = world // len(nodes)
    short = [node for node in nodes if node.gpus < per_node]
    if short:
        names = ", ".join(f"{node.name} ({node.gpus})" for node in short)
        raise PlanError(
            f"recipe {recipe.recipe_id} needs {per_node} GPUs per node (tp "
            f"{recipe.tensor_parallel_size} × pp {recipe.pipeline_parallel_size} over "
            f"{len(nodes)} nodes) but {cluster.path} "
            f"gives {names}; use nodes with more GPUs or raise required_nodes"
        )
    if recipe.nccl_profile is not None and recipe.nccl_profile not in cluster.nccl:
        close = difflib.get_close_matches(recipe.nccl_profile, cluster.nccl, n=1)
        hint = (
            f"did you mean '{close[0]}'?"
            if close
            else f"add [nccl.{recipe.nccl_profile}] to {cluster.path}"
        )
        raise PlanError(
            f"recipe {recipe.recipe_id}: nccl_profile '{recipe.nccl_profile}' is not defined in "
            f"{cluster.path} (profiles: {', '.join(cluster.nccl) or 'none'}); {hint}"
        )
    return per_node


def _engram_source(recipe: Recipe) -> RepoRef:
    """The snapshot whose same-named file a local_file is a per-rank copy of."""
    sources = recipe.composed_model.sources if recipe.composed_model else []
    chosen = next((s for s in sources if s.repo == recipe.model), sources[0] if sources else None)
    if chosen is not None:
        return RepoRef(repo=chosen.repo, revision=chosen.revision)
    return RepoRef(repo=recipe.model, revision=recipe.model_revision)


def _local_file_kinds(recipe: Recipe, nas_hf_cache: str) -> list[LocalFileKind]:
    composed = recipe.composed_model
    return [
        LocalFileKind(dest=local.host, kind=kind, why=why)
        for local in (composed.local_files if composed else [])
        for kind, why in [local_file_kind(local, _engram_source(recipe), nas_hf_cache)]
    ]


def _plain_stages(recipe: Recipe, kinds: Sequence[LocalFileKind]) -> list[PlainStage]:
    """The plain files, the same on every node; an ops host file is read here for its sha256."""
    plain_dests = {decided.dest for decided in kinds if decided.kind == "plain"}
    stages = []
    for local in recipe.composed_model.local_files if recipe.composed_model else []:
        if local.host not in plain_dests:
            continue
        ops_file = recipe.ops_file(local)
        sha256, size = _digest(ops_file) if ops_file is not None else (None, None)
        stages.append(
            PlainStage(
                filename=posixpath.basename(local.host),
                dest=local.host,
                repo=None if ops_file is not None else _engram_source(recipe),
                ops_file=str(ops_file.resolve()) if ops_file is not None else None,
                sha256=sha256,
                size=size,
            )
        )
    return stages


def _digest(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    try:
        with path.open("rb") as file:
            while chunk := file.read(1 << 20):
                digest.update(chunk)
    except OSError as exc:
        raise PlanError(
            f"local file {path}: cannot read it on this host ({exc.strerror or exc}); fix the "
            "recipe's from_file or the file"
        ) from None
    return digest.hexdigest(), path.stat().st_size


def _node_memory(node: Node) -> NodeMemory:
    return NodeMemory(
        total_bytes=round(node.memory_gib * GIB),
        unified=node.unified_memory,
        engine_overhead_bytes=round(node.engine_overhead_gib * GIB),
    )


def _engine_memory(recipe: Recipe) -> EngineMemory:
    flags, problems = read_memory_flags(recipe.vllm_args, recipe.env)
    if problems:
        raise RecipeError(
            "\n".join(f"recipe {recipe.recipe_id}: {problem}" for _, problem in problems)
        )
    return EngineMemory(
        model=recipe.model,
        model_revision=recipe.model_revision,
        drafter=recipe.speculative_model,
        tensor_parallel_size=recipe.tensor_parallel_size,
        pipeline_parallel_size=recipe.pipeline_parallel_size,
        flags=flags,
    )


def make_plan(recipe: Recipe, cluster: Cluster, nodes: Sequence[str] | None = None) -> Plan:
    """What happens on each node. `nodes` names them in rank order; default: the first N."""
    selected = cluster.select(recipe.required_nodes, nodes)
    per_node = _check_placement(recipe, cluster, selected)
    dep_id = deployment_id(recipe.recipe_id, [node.name for node in selected])
    head = selected[0]
    composed = recipe.composed_model
    kinds = _local_file_kinds(recipe, cluster.nas.hf_cache)
    plain = _plain_stages(recipe, kinds)
    node_plans = []
    composed_root = posixpath.join(cluster.node_paths.composed_root, dep_id)
    for rank, node in enumerate(selected):
        tp_ranks = sorted(
            {r % recipe.tensor_parallel_size for r in range(rank * per_node, (rank + 1) * per_node)}
        )
        container = container_spec(
            recipe, cluster, selected, rank, dep_id, composed_root if composed else None
        )
        local_files = [decided.dest for decided in kinds]
        engram = [
            EngramStage(
                repo=_engram_source(recipe),
                filename=posixpath.basename(decided.dest),
                dest=decided.dest,
                ranks=tp_ranks,
                tp_size=recipe.tensor_parallel_size,
            )
            for decided in kinds
            if decided.kind == "engram"
        ]
        node_plans.append(
            NodePlan(
                node=node.name,
                rank=rank,
                role="head" if rank == 0 else "worker",
                ssh=ssh_spec(cluster, node),
                fabric_ip=node.fabric_ip,
                fabric_netdev=node.fabric_netdev,
                roce_hcas=node.roce_hcas,
                gid_index=node.gid_index,
                tp_ranks=tp_ranks,
                memory=_node_memory(node),
                container=container,
                engram=engram,
                plain=plain,
                composed=ComposedPlan(
                    root=composed_root,
                    sources=[RepoRef(repo=s.repo, revision=s.revision) for s in composed.sources],
                    local_files=local_files,
                    mount=composed.mount,
                )
                if composed
                else None,
            )
        )
    default_boot = [MarkerSpec(name=m.name, pattern=m.pattern) for m in DEFAULT_BOOT_MARKERS]
    return Plan(
        deployment_id=dep_id,
        recipe=recipe.recipe_id,
        cluster=cluster.name,
        served_model_name=recipe.served_model_name,
        api_port=recipe.api_port,
        endpoint=f"http://{head.fabric_ip}:{recipe.api_port}",
        api_key=SecretStr(recipe.api_key) if recipe.api_key is not None else None,
        readiness_timeout_s=recipe.readiness_timeout_s,
        boot_markers=list(recipe.boot_markers) or default_boot,
        failure_markers=[
            *(MarkerSpec(name=m.name, pattern=m.pattern) for m in DEFAULT_FAILURE_MARKERS),
            *recipe.failure_markers,
        ],
        smoke=recipe.smoke,
        repos=recipe.hf_repos,
        nas_hf_cache=cluster.nas.hf_cache,
        runs_dir=cluster.nas.runs_dir,
        hub_endpoint=cluster.hub.endpoint,
        hub_allow_http_token=cluster.hub.allow_http_token,
        prefetch_include=recipe.prefetch.include,
        prefetch_exclude=recipe.prefetch.exclude,
        docker_image=recipe.docker_image,
        docker_image_dir=recipe.docker_image_dir,
        registry=cluster.docker.registry,
        drop_page_cache=cluster.docker.drop_page_cache,
        blocked=recipe.blocked_reason,
        memory=_engine_memory(recipe),
        nodes=[_with_spec_label(node) for node in node_plans],
        local_files=kinds,
        quality=recipe.quality,
    )
