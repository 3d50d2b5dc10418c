"""The container each node of a plan runs: its `docker run` argv, its env (plain, and secret
through an env file), its mounts, its labels and the `vllm serve` command (sparkdeploy.spec.plan
puts one in each node's plan). Plain data, like the plan.
"""

from __future__ import annotations

import posixpath

from pydantic import BaseModel, ConfigDict, SecretStr

from sparkdeploy.errors import PlanError
from sparkdeploy.secrecy import FLAG_ENV, Secret
from sparkdeploy.spec.cluster import Cluster, Node
from sparkdeploy.spec.recipe import Recipe

MASTER_PORT = 29501  # vLLM's mp backend: workers reach the head's store here
LABEL_PREFIX = "sparkdeploy."


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


def container_spec(
    recipe: Recipe,
    cluster: Cluster,
    selected: list[Node],
    rank: int,
    deployment_id: str,
    composed_root: str | None,
) -> ContainerSpec:
    """The container the node of `rank` among the `selected` runs for the deployment; its
    composed model (if the recipe has one) is at `composed_root` on the node."""
    node = selected[rank]
    hf_cache = recipe.composed_model.mount if recipe.composed_model else cluster.nas.hf_cache
    entrypoint, command = _commands(recipe, rank, selected)
    env, secret_env = _node_env(recipe, cluster, node, hf_cache)
    return ContainerSpec(
        name=f"sparkdeploy-{deployment_id}-{node.name}",
        image=recipe.docker_image,
        entrypoint=entrypoint,
        command=command,
        env=env,
        secret_env=secret_env,
        labels={
            f"{LABEL_PREFIX}deployment": deployment_id,
            f"{LABEL_PREFIX}recipe": recipe.recipe_id,
            f"{LABEL_PREFIX}node": node.name,
            f"{LABEL_PREFIX}rank": str(rank),
        },
        mounts=_mounts(recipe, cluster, node, composed_root),
        network_host=True,
        ipc_host=True,
        shm_size=recipe.shm_size,
        gpus=cluster.docker.gpus or None,
        ulimits=dict(cluster.docker.ulimits),
        extra_run_options=list(cluster.docker.run_options),
    )


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
    # Each mount with the key that sets it, to name both of two at one place in the container.
    mounts: list[tuple[str, Mount]] = []
    if recipe.composed_model is not None and composed_root is not None:
        composed = Mount(source=composed_root, target=recipe.composed_model.mount, read_only=True)
        mounts.append(("the recipe's composed_model.mount", composed))
    # Composed snapshots are symlinks into the NAS cache: it must resolve at its own path.
    nas = Mount(source=cluster.nas.hf_cache, target=cluster.nas.hf_cache, read_only=True)
    mounts.append((f"{cluster.path}'s nas.hf_cache (the NAS cache, mounted at its own path)", nas))
    for index, extra in enumerate(recipe.extra_mounts):
        host = extra.host
        if host == "~" or host.startswith("~/"):
            host = node.home + host[1:]
        mount = Mount(source=host, target=extra.container, read_only=extra.read_only)
        mounts.append((f"the recipe's extra_mounts[{index}].container", mount))
    first_by_target: dict[str, str] = {}
    for key, mount in mounts:
        if ":" in mount.source or ":" in mount.target:
            raise PlanError(
                f"recipe {recipe.recipe_id}: mount {mount.source} -> {mount.target} has a ':' "
                "that docker's -v cannot carry; rename the path"
            )
        first = first_by_target.setdefault(posixpath.normpath(mount.target), key)
        if first != key:
            # docker refuses to start such a container ("Duplicate mount point"), on the node.
            raise PlanError(
                f"recipe {recipe.recipe_id}: {key} and {first} both mount at {mount.target} in "
                "the container; docker allows one mount at a place: move the recipe's one"
            )
    return [mount for _, mount in mounts]


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
