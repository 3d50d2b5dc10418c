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
from sparkdeploy.secrecy import FLAG_ENV, Secret, keyed_digest
from sparkdeploy.spec.cluster import Cluster, GidIndex, Node, RoceHcas
from sparkdeploy.spec.local_files import Kind, local_file_kind
from sparkdeploy.spec.memory import EngineMemory, FitReport, NodeMemory, read_memory_flags
from sparkdeploy.spec.recipe import MarkerSpec, Recipe, RepoRef, SmokeOptions
from sparkdeploy.units import GIB
from sparkdeploy.vllm.args import argv_has_flag
from sparkdeploy.vllm.markers import DEFAULT_BOOT_MARKERS, DEFAULT_FAILURE_MARKERS

AUTO_TOOL_CHOICE_FLAG = "--enable-auto-tool-choice"
REASONING_PARSER_FLAG = "--reasoning-parser"

__all__ = [
    "ComposedPlan",
    "ContainerSpec",
    "EngramStage",
    "LocalFileKind",
    "MarkerSpec",
    "Mount",
    "NodePlan",
    "PlainStage",
    "Plan",
    "RepoRef",
    "SmokeOptions",
    "SshSpec",
    "make_plan",
]

MASTER_PORT = 29501  # vLLM's mp backend: workers reach the head's store here
LABEL_PREFIX = "sparkdeploy."
# The digest of what a node runs (spec_digest): a running copy started from another version of
# the recipe or inventory is told apart from one started from this plan.
SPEC_LABEL = f"{LABEL_PREFIX}spec"
# A keyed digest of the secret values a container was started with (with_secrets_label): the
# spec digest masks them, so without it a rotated secret would be found "already serving".
SECRETS_LABEL = f"{LABEL_PREFIX}secrets"


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Mount(_Data):
    source: str  # on the node
    target: str  # in the container
    read_only: bool


class ContainerSpec(_Data):
    name: str
    image: str
    entrypoint: list[str]  # empty: the image's own entrypoint
    command: list[str]  # argv after the entrypoint
    env: dict[str, str]
    secret_env: dict[str, Secret]  # through an env file, never the argv (sparkdeploy.secrecy)
    labels: dict[str, str]
    mounts: list[Mount]
    network_host: bool
    ipc_host: bool
    shm_size: str | None
    gpus: str | None
    ulimits: dict[str, str]
    extra_run_options: list[str]

    def docker_run_argv(self) -> list[str]:
        """The equivalent `docker run` argv, secret_env aside (boot adds it as --env-file)."""
        argv = ["docker", "run", "-d", "--name", self.name]
        for key, value in self.labels.items():
            argv += ["--label", f"{key}={value}"]
        if self.network_host:
            argv += ["--network", "host"]
        if self.ipc_host:
            argv += ["--ipc", "host"]
        if self.shm_size:
            argv += ["--shm-size", self.shm_size]
        if self.gpus:
            argv += ["--gpus", self.gpus]
        for kind, limit in self.ulimits.items():
            argv += ["--ulimit", f"{kind}={limit}"]
        for key, value in self.env.items():
            argv += ["-e", f"{key}={value}"]
        for mount in self.mounts:
            argv += ["-v", f"{mount.source}:{mount.target}" + (":ro" if mount.read_only else "")]
        argv += self.extra_run_options
        if self.entrypoint:
            argv += ["--entrypoint", self.entrypoint[0]]
        return [*argv, self.image, *self.entrypoint[1:], *self.command]

    def env_file(self) -> bytes:
        """secret_env as docker's --env-file reads it: one VAR=value a line, taken literally."""
        lines = (f"{key}={value.get_secret_value()}\n" for key, value in self.secret_env.items())
        return "".join(lines).encode()


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


def _node_env(
    recipe: Recipe, cluster: Cluster, node: Node, hf_cache: str
) -> tuple[dict[str, str], dict[str, SecretStr]]:
    """Profile, then the recipe's own env, then what only this node knows; split into the
    plain env and the secret one (sparkdeploy.secrecy)."""
    env = dict(cluster.nccl.get(recipe.nccl_profile or "", {}))
    env.update(recipe.env)
    # vLLM reads VLLM_API_KEY and HF_TOKEN as it reads their flags, and a flag would show in `ps`.
    env.update(recipe.secret_flag_env)
    env.update(
        {
            "VLLM_HOST_IP": node.fabric_ip,
            "NCCL_SOCKET_IFNAME": node.fabric_netdev,
            "GLOO_SOCKET_IFNAME": node.fabric_netdev,
            "UCX_NET_DEVICES": node.fabric_netdev,
        }
    )
    if isinstance(node.roce_hcas, list):
        env["NCCL_IB_HCA"] = ",".join(node.roce_hcas)
    if isinstance(node.gid_index, int):
        env["NCCL_IB_GID_INDEX"] = str(node.gid_index)
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_HUB_CACHE"] = hf_cache
    plain = {key: value for key, value in env.items() if not recipe.is_secret_env(key)}
    secret = {key: SecretStr(value) for key, value in env.items() if recipe.is_secret_env(key)}
    return plain, secret


def _mounts(recipe: Recipe, cluster: Cluster, node: Node, composed_root: str | None) -> list[Mount]:
    mounts = []
    if recipe.composed_model is not None and composed_root is not None:
        mounts.append(
            Mount(source=composed_root, target=recipe.composed_model.mount, read_only=True)
        )
    # Composed snapshots are symlinks into the NAS cache: it must resolve at its own path.
    mounts.append(Mount(source=cluster.nas.hf_cache, target=cluster.nas.hf_cache, read_only=True))
    for extra in recipe.extra_mounts:
        host = extra.host
        if host == "~" or host.startswith("~/"):
            host = node.home + host[1:]
        mounts.append(Mount(source=host, target=extra.container, read_only=extra.read_only))
    for mount in mounts:
        if ":" in mount.source or ":" in mount.target:
            raise PlanError(
                f"recipe {recipe.recipe_id}: mount {mount.source} -> {mount.target} has a ':' "
                "that docker's -v cannot carry; rename the path"
            )
    return mounts


def serve_argv(recipe: Recipe) -> list[str]:
    """`MODEL args...` with the parallel sizes and backend every node shares."""
    args = recipe.vllm_args
    for flag in FLAG_ENV:
        if args.value(flag) is not None:  # passed as its env (_node_env); a bare flag stays
            args = args.without(flag)
    argv = [recipe.model, *args.argv()]
    if recipe.model_revision is not None:
        argv += ["--revision", recipe.model_revision]
    argv += ["--tensor-parallel-size", str(recipe.tensor_parallel_size)]
    argv += ["--pipeline-parallel-size", str(recipe.pipeline_parallel_size)]
    if recipe.vllm_args.find("--distributed-executor-backend") is None:
        argv += ["--distributed-executor-backend", recipe.distributed_backend]
    return argv


def _mp_flags(rank: int, count: int, head: Node) -> list[str]:
    if count == 1:
        return []
    flags = ["--nnodes", str(count), "--node-rank", str(rank)]
    flags += ["--master-addr", head.fabric_ip, "--master-port", str(MASTER_PORT)]
    return [*flags, "--headless"] if rank else flags


def _commands(recipe: Recipe, rank: int, selected: list[Node]) -> tuple[list[str], list[str]]:
    """The container's entrypoint and command: `vllm serve` on every node (the mp backend)."""
    command = [*serve_argv(recipe), *_mp_flags(rank, len(selected), selected[0])]
    return recipe.entrypoint or [], command


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
    for rank, node in enumerate(selected):
        composed_root = posixpath.join(cluster.node_paths.composed_root, dep_id)
        hf_cache = composed.mount if composed else cluster.nas.hf_cache
        tp_ranks = sorted(
            {r % recipe.tensor_parallel_size for r in range(rank * per_node, (rank + 1) * per_node)}
        )
        container_entrypoint, command = _commands(recipe, rank, selected)
        env, secret_env = _node_env(recipe, cluster, node, hf_cache)
        container = ContainerSpec(
            name=f"sparkdeploy-{dep_id}-{node.name}",
            image=recipe.docker_image,
            entrypoint=container_entrypoint,
            command=command,
            env=env,
            secret_env=secret_env,
            labels={
                f"{LABEL_PREFIX}deployment": dep_id,
                f"{LABEL_PREFIX}recipe": recipe.recipe_id,
                f"{LABEL_PREFIX}node": node.name,
                f"{LABEL_PREFIX}rank": str(rank),
            },
            mounts=_mounts(recipe, cluster, node, composed_root if composed else None),
            network_host=True,
            ipc_host=True,
            shm_size=recipe.shm_size,
            gpus=cluster.docker.gpus or None,
            ulimits=dict(cluster.docker.ulimits),
            extra_run_options=list(cluster.docker.run_options),
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
    )
