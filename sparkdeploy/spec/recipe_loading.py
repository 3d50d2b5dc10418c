"""A recipe file loaded and checked: `load_recipe` reports every problem of a file at once, each
as `file:line: key: what is wrong and what to do`.

The model's types (sparkdeploy.spec.recipe) say what each key may hold; the checks here are
what they cannot express: args the plan sets itself, secrets that would show in an argv, paths
that lead out of where they must stay, env the plan sets per node, sizes that do not divide.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from sparkdeploy.errors import RecipeError
from sparkdeploy.node.hfcache import relative_path_problem
from sparkdeploy.secrecy import (
    API_KEY_FLAG,
    FLAG_ENV,
    is_secret_flag,
    is_secret_name,
    unsafe_value_problem,
)
from sparkdeploy.spec.memory import read_memory_flags
from sparkdeploy.spec.quality import ENV_NAME_RULE, TOOL_CHOICE_FLAGS, is_env_name, quality_problems
from sparkdeploy.spec.recipe import (
    RAY_REFUSAL,
    READINESS_ENV,
    ComposedLocalFile,
    Recipe,
    SmokeOptions,
)
from sparkdeploy.spec.toml_validation import validate_document
from sparkdeploy.spec.tomlfile import KeyPath, TomlDocument, format_key, load_toml
from sparkdeploy.vllm.args import VllmArgs, is_flag, parse_args

# Flags the plan sets from recipe keys or per node; a recipe that also sets them would fight it.
_PLAN_FLAGS = {
    "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size",
    "--pipeline-parallel-size": "pipeline_parallel_size",
    "-pp": "pipeline_parallel_size",
    "--nnodes": "required_nodes",
    "--node-rank": "the node order of the cluster inventory",
    "--master-addr": "the head node's fabric_ip",
    "--master-port": "the plan (29501)",
    "--headless": "the plan (on workers)",
    "--revision": "model_revision (so the prefetch fetches the same revision)",
}
# Env the plan injects per node (the fabric differs per node) or sets from the inventory.
_PLAN_ENV = {
    "VLLM_HOST_IP": "each node's fabric_ip",
    "NCCL_SOCKET_IFNAME": "each node's fabric_netdev",
    "GLOO_SOCKET_IFNAME": "each node's fabric_netdev",
    "UCX_NET_DEVICES": "each node's fabric_netdev",
    "NCCL_IB_HCA": "each node's roce_hcas",
    "NCCL_IB_GID_INDEX": "each node's gid_index",
    "HF_HUB_CACHE": "the plan (the composed mount or the NAS cache)",
}

Where = Callable[[KeyPath], str]

# The port vLLM's --port takes (an int the OS can bind).
_PORTS = range(1, 65536)


def _arg_problems(recipe: Recipe, where: Where, backend_known: bool) -> list[str]:
    """Problems of args; the backend's agreement is checked only if `backend_known` (valid)."""
    args, problems = parse_args(recipe.args, where=lambda index: where(("args", index)))
    for flag in args.flags:
        at = where(("args", flag.index))
        if flag.canonical in _PLAN_FLAGS:
            problems.append(
                f"{at}: {flag.name} is set by the plan from {_PLAN_FLAGS[flag.canonical]}; "
                "remove it from args"
            )
    backend = args.find("--distributed-executor-backend")
    if backend is not None and backend.value == "ray":
        problems.append(
            f"{where(('args', backend.index))}: --distributed-executor-backend ray is refused: "
            f"{RAY_REFUSAL}"
        )
    elif backend_known and backend is not None and backend.value != recipe.distributed_backend:
        problems.append(
            f"{where(('args', backend.index))}: --distributed-executor-backend {backend.value} "
            f'contradicts distributed_backend = "{recipe.distributed_backend}"; make them agree '
            "(or drop the flag: the plan adds it)"
        )
    port = args.find("--port")
    if port is not None and not _is_port(port.value or ""):
        problems.append(
            f"{where(('args', port.index))}: --port {port.value!r} is not a number from "
            f"{_PORTS.start} to {_PORTS.stop - 1}: write the port vLLM serves on"
        )
    problems += _secret_flag_problems(recipe, args, where)
    served = args.find("--served-model-name")
    if served is not None and served.value is None:
        problems.append(f"{where(('args', served.index))}: --served-model-name needs a value")
    return problems


def _is_port(text: str) -> bool:
    # isdigit() alone takes "²" and "٣", which int() then refuses.
    return text.isascii() and text.isdigit() and int(text) in _PORTS


def _chooses_tools(args: VllmArgs) -> bool:
    """Whether the engine calls tools on its own (what a tool-call eval needs)."""
    return all(args.find(flag) is not None for flag in TOOL_CHOICE_FLAGS)


# What each secret flag vLLM also reads from the env sets, for the errors.
_SECRET_FLAG_WHAT = {API_KEY_FLAG: "the API key", "--hf-token": "the HF token"}


def _secret_flag_problems(recipe: Recipe, args: VllmArgs, where: Where) -> list[str]:
    """A secret flag's value must reach vLLM through the env (secrecy.FLAG_ENV), never an argv
    that `ps` on the node shows; problems never quote the value."""
    problems = []
    for flag in args.flags:
        if not is_secret_flag(flag.name):
            continue
        at = where(("args", flag.index))
        env = FLAG_ENV.get(flag.canonical)
        if flag.canonical == API_KEY_FLAG and not flag.value:
            problems.append(f"{at}: {API_KEY_FLAG} needs a value (the key clients must send)")
        elif flag.value is None:
            continue  # a bare flag: `--hf-token` alone is vLLM's "use the stored login"
        elif not flag.value:
            problems.append(f"{at}: {flag.name} has an empty value; write the value or remove it")
        elif env is None:
            problems.append(
                f"{at}: {flag.name} takes a secret, and a flag's value shows in `ps` on the node;"
                f" only {' and '.join(FLAG_ENV)} reach vLLM through its env here: set the env"
                " variable the engine reads in its place in [env] (a secret by its name or"
                " listed in secret_env), or remove the flag"
            )
        elif env in recipe.env:
            what = _SECRET_FLAG_WHAT[flag.canonical]
            problems.append(f"{at}: {flag.name} and env.{env} both set {what}; keep one")
        elif (problem := unsafe_value_problem(flag.value)) is not None:
            problems.append(f"{at}: {flag.name}'s value {problem}")
    return problems


def _secret_value_at(data: dict[str, Any]) -> Callable[[KeyPath], bool]:
    """Whether a key of a recipe file's raw `data` holds a secret value, whatever its type:
    an [env] entry with a secret's name or listed in secret_env, or the value after a secret
    flag in args. Type errors are found before the recipe is built, so this reads the file."""
    marked = [name for name in data.get("secret_env") or [] if isinstance(name, str)]
    raw_args = data.get("args")
    args = raw_args if isinstance(raw_args, list) else []

    def secret(key_path: KeyPath) -> bool:
        if len(key_path) >= 2 and key_path[0] == "env" and isinstance(key_path[1], str):
            return is_secret_name(key_path[1], marked)
        if len(key_path) >= 2 and key_path[0] == "args" and isinstance(key_path[1], int):
            before = args[key_path[1] - 1] if 0 < key_path[1] <= len(args) else None
            flag = isinstance(before, str) and is_flag(before) and "=" not in before
            return flag and is_secret_flag(str(before))
        return False

    return secret


def _path_problems(recipe: Recipe, where: Where, broken: frozenset[str]) -> list[str]:
    problems = []
    image_dir = recipe.docker_image_dir
    if "docker_image_dir" not in broken and image_dir is not None:
        parts = PurePosixPath(image_dir).parts
        # It is joined to images/ on the flow host: it must not lead out of there.
        if not parts or image_dir.startswith("/") or ".." in parts:
            problems.append(
                f"{where(('docker_image_dir',))}: docker_image_dir {image_dir!r} must name a"
                " directory under images/: a relative path without '..'"
            )
    # Where the container sees each mount, by the key that sets it.
    targets: list[tuple[KeyPath, str]] = []
    if "composed_model" not in broken and recipe.composed_model is not None:
        composed = recipe.composed_model
        mount_key: KeyPath = ("composed_model", "mount")
        targets.append((mount_key, composed.mount))
        if not composed.mount.startswith("/"):
            problems.append(
                f"{where(mount_key)}: composed_model.mount "
                f"{composed.mount!r} must be an absolute path in the container"
            )
        problems += _mount_colon_problems([(mount_key, composed.mount)], where)
        for index, local in enumerate(composed.local_files):
            local_key: KeyPath = ("composed_model", "local_files", index, "host")
            if not local.host.startswith("/"):
                problems.append(
                    f"{where(local_key)}: {format_key(local_key)} {local.host!r} must be an "
                    "absolute path on the node"
                )
            elif ".." in PurePosixPath(local.host).parts:
                # The file is written there as root on every node: '..' would lead anywhere.
                problems.append(
                    f"{where(local_key)}: {format_key(local_key)} {local.host!r} holds a '..' "
                    "component: write the path it means without '..'"
                )
            problems += _local_file_problems(local, index, where)
    for index, mount in enumerate([] if "extra_mounts" in broken else recipe.extra_mounts):
        host_key: KeyPath = ("extra_mounts", index, "host")
        container_key: KeyPath = ("extra_mounts", index, "container")
        targets.append((container_key, mount.container))
        if not (mount.host.startswith("/") or mount.host == "~" or mount.host.startswith("~/")):
            problems.append(
                f"{where(host_key)}: {format_key(host_key)} {mount.host!r} must be absolute or "
                "start with ~/ (the SSH user's home on the node)"
            )
        if not mount.container.startswith("/"):
            problems.append(
                f"{where(container_key)}: {format_key(container_key)} {mount.container!r} must "
                "be an absolute path"
            )
        problems += _mount_colon_problems(
            [(host_key, mount.host), (container_key, mount.container)], where
        )
    return problems + _duplicate_target_problems(targets, where)


def _mount_colon_problems(paths: list[tuple[KeyPath, str]], where: Where) -> list[str]:
    return [
        f"{where(key)}: {format_key(key)} {path!r} holds a ':', which docker's -v reads as the "
        "end of the path; use a path without ':' (a symlink to it, on the node)"
        for key, path in paths
        if ":" in path
    ]


def _duplicate_target_problems(targets: list[tuple[KeyPath, str]], where: Where) -> list[str]:
    """Two mounts at one place in the container: docker refuses to start it ("Duplicate mount
    point"), on the node, after the prefetch."""
    problems = []
    first_by_target: dict[str, KeyPath] = {}
    for key, target in targets:
        normal = posixpath.normpath(target)
        first = first_by_target.setdefault(normal, key)
        if first != key:
            problems.append(
                f"{where(key)}: {format_key(key)} {target!r} is where {format_key(first)} "
                f"({where(first)}) mounts too: give each mount its own place in the container"
            )
    return problems


def _local_file_problems(local: ComposedLocalFile, index: int, where: Where) -> list[str]:
    """from_file and kind of one local file (from_file's existence: _missing_ops_files)."""
    problems = []
    name = PurePosixPath(local.host).name
    if local.from_file is not None:
        key: KeyPath = ("composed_model", "local_files", index, "from_file")
        if _leads_out(local.from_file):
            problems.append(
                f"{where(key)}: {format_key(key)} {local.from_file!r} must name a file under "
                "the recipe's dir: a relative path without '..'"
            )
    if local.kind == "engram":
        key = ("composed_model", "local_files", index, "kind")
        if not name.endswith(".safetensors"):
            problems.append(
                f'{where(key)}: {format_key(key)} = "engram" but {name} is not a .safetensors '
                'file, so it holds no Engram table; remove kind (or set "plain")'
            )
        elif local.from_file is not None:
            problems.append(
                f'{where(key)}: {format_key(key)} = "engram" with from_file: an Engram copy is '
                "made from the NAS snapshot on each node; remove from_file (or kind)"
            )
    return problems


def _leads_out(relative: str) -> bool:
    """Whether a path joined to the recipe dir on the flow host would lead out of it."""
    parts = PurePosixPath(relative).parts
    return not parts or relative.startswith("/") or ".." in parts


def _missing_ops_files(recipe: Recipe, recipe_dir: Path, where: Where) -> list[str]:
    """Each local file's from_file must be a file under the recipe dir (one whose path leads out
    of it is _local_file_problems'; here, one that is a symlink to a file outside it)."""
    problems = []
    local_files = recipe.composed_model.local_files if recipe.composed_model else []
    for index, local in enumerate(local_files):
        path = recipe.ops_file(local)
        if path is None or _leads_out(str(local.from_file)):
            continue
        key: KeyPath = ("composed_model", "local_files", index, "from_file")
        if path.is_file() and not path.resolve().is_relative_to(recipe_dir.resolve()):
            problems.append(
                f"{where(key)}: {format_key(key)}: {path} leads to {path.resolve()}, outside the "
                "recipe's dir (a symlink); put the file itself under the recipe's dir"
            )
        elif not path.is_file():
            problems.append(
                f"{where(key)}: {format_key(key)}: {path} does not exist (or is not a file); "
                f"put the file for {PurePosixPath(local.host).name} there, or fix from_file "
                "(relative to the recipe's dir), or remove it to take the file from the NAS"
            )
    return problems


def _secret_problems(recipe: Recipe, where: Where) -> list[str]:
    problems = []
    for index, name in enumerate(recipe.secret_env):
        if not is_env_name(name):
            problems.append(
                f"{where(('secret_env', index))}: secret_env names {name!r}, which is not an "
                f"environment variable's name ({ENV_NAME_RULE}); write the [env] name it means"
            )
        elif name not in recipe.env:
            problems.append(
                f"{where(('secret_env', index))}: secret_env names {name!r}, which [env] does"
                " not set; add it to [env] or remove it from secret_env"
            )
    for name, value in recipe.env.items():
        problem = unsafe_value_problem(value) if recipe.is_secret_env(name) else None
        if problem is not None:
            problems.append(f"{where(('env', name))}: env.{name} (a secret) {problem}")
    return problems


def recipe_problems(
    recipe: Recipe, where: Where, broken: frozenset[str] = frozenset()
) -> list[str]:
    """Consistency problems the model's types cannot express; `where` names a key's place.

    A check reading a field in `broken` (a field whose own problem is already reported, so it
    holds its default or nothing) is skipped: its finding would be about a value not in the file.
    """

    def valid(*fields: str) -> bool:
        return broken.isdisjoint(fields)

    problems: list[str] = []
    args_valid = valid("args")
    if args_valid:
        arg_problems = _arg_problems(recipe, where, backend_known=valid("distributed_backend"))
        args_valid = not arg_problems
        problems += arg_problems
    problems += _path_problems(recipe, where, broken)
    if args_valid and valid("env"):
        _, memory_problems = read_memory_flags(recipe.vllm_args, recipe.env)
        problems += [f"{where(key)}: {problem}" for key, problem in memory_problems]
    if valid("env"):
        problems += _env_problems(recipe, where)
    if valid("env", "secret_env"):
        problems += _secret_problems(recipe, where)
    if valid("tensor_parallel_size", "pipeline_parallel_size", "required_nodes"):
        world = recipe.tensor_parallel_size * recipe.pipeline_parallel_size
        if world % recipe.required_nodes:
            problems.append(
                f"{where(('required_nodes',))}: required_nodes = {recipe.required_nodes} does "
                f"not divide tensor_parallel_size × pipeline_parallel_size = {world}; every node "
                "runs the same number of ranks"
            )
    if args_valid and valid("quality") and recipe.quality is not None:
        problems += quality_problems(recipe.quality, _chooses_tools(recipe.vllm_args), where)
    if valid("entrypoint"):
        problems += _entrypoint_problems(recipe, where)
    problems += _revision_problems(recipe, where, broken)
    if valid("blocked") and recipe.blocked is not None and not recipe.blocked.strip():
        problems.append(
            f"{where(('blocked',))}: blocked is empty; say why the recipe is blocked or remove it"
        )
    repo_fields = ("model", "model_revision", "parent_model", "parent_model_revision")
    if args_valid and valid(*repo_fields, "composed_model"):
        try:
            recipe.hf_repos  # noqa: B018 - raises on conflicting revision pins
        except RecipeError as exc:
            problems.append(f"{where(('model_revision',))}: {exc}")
    return problems


def _entrypoint_problems(recipe: Recipe, where: Where) -> list[str]:
    """Each item is one word of the argv docker runs (no shell splits it)."""
    problems = []
    for index, item in enumerate(recipe.entrypoint or []):
        at = where(("entrypoint", index))
        if not item.strip():
            problems.append(f"{at}: entrypoint[{index}] is empty: remove it")
        elif any(char.isspace() for char in item):
            problems.append(
                f"{at}: entrypoint[{index}] {item!r} holds whitespace, and no shell splits it: "
                'write each word as an item of its own (e.g. ["vllm", "serve"])'
            )
    return problems


def _revision_problems(recipe: Recipe, where: Where, broken: frozenset[str]) -> list[str]:
    revisions: list[tuple[KeyPath, str | None]] = []
    if "model_revision" not in broken:
        revisions.append((("model_revision",), recipe.model_revision))
    if "parent_model_revision" not in broken:
        revisions.append((("parent_model_revision",), recipe.parent_model_revision))
    if "composed_model" not in broken and recipe.composed_model is not None:
        revisions += [
            (("composed_model", "sources", index, "revision"), source.revision)
            for index, source in enumerate(recipe.composed_model.sources)
        ]
    problems = []
    for key, revision in revisions:
        problem = None if revision is None else relative_path_problem(revision)
        if problem is not None:
            problems.append(
                f"{where(key)}: {format_key(key)} {revision!r} {problem}: a revision names a "
                "file under the NAS cache's refs/; give a branch, tag or commit sha (or remove "
                "the key for the default branch)"
            )
    return problems


def _env_problems(recipe: Recipe, where: Where) -> list[str]:
    problems = [
        f"{where(('env', name))}: env name {name!r} is not an environment variable's name "
        f"({ENV_NAME_RULE}); rename it"
        for name in recipe.env
        if not is_env_name(name)
    ]
    for key, source in _PLAN_ENV.items():
        if key in recipe.env:
            problems.append(
                f"{where(('env', key))}: env.{key} is set per node from {source}; remove it"
            )
    if recipe.env.get("HF_HUB_OFFLINE", "1") != "1":
        problems.append(
            f'{where(("env", "HF_HUB_OFFLINE"))}: env.HF_HUB_OFFLINE must be "1": engines read '
            'the prefetched cache and never the hub; remove it or set "1"'
        )
    timeout = recipe.env.get(READINESS_ENV)
    # vLLM reads it with int() (vllm-project/vllm, vllm/envs.py): "60.5" or "inf" stops its start.
    if timeout is not None and not (re.fullmatch("[0-9]+", timeout) and int(timeout) > 0):
        problems.append(
            f"{where(('env', READINESS_ENV))}: env.{READINESS_ENV} {timeout!r} must be a "
            "positive number of seconds without a fraction (vLLM reads it with int())"
        )
    return problems


# Tables whose keys are free (names of env variables, of chat template kwargs): to TOML, a key
# written below one of them belongs to it, so a recipe key put there by mistake would be taken as
# one of its entries, and its own setting (a revision pin, say) lost without a word. Each with
# the keys that must not be read so, and where they belong.
_FREE_FORM_TABLES: dict[tuple[str, ...], tuple[frozenset[str], str, str]] = {
    ("env",): (
        frozenset(Recipe.model_fields),
        "a top-level key of the recipe",
        "move it above the first [table]",
    ),
    ("smoke", "chat_template_kwargs"): (
        frozenset(Recipe.model_fields) | frozenset(SmokeOptions.model_fields),
        "a key of the recipe or of [smoke]",
        "move a top-level key above the first [table], a [smoke] key above this table's header",
    ),
}


def _without_misplaced_keys(document: TomlDocument) -> tuple[TomlDocument, list[str]]:
    """The document without the recipe's own keys that its free-form tables hold, and a problem
    for each, naming the table that took it and where to move it."""
    data = dict(document.data)
    problems = []
    for table_path, (own_keys, what, fix) in _FREE_FORM_TABLES.items():
        parent: dict[str, Any] = data
        for part in table_path[:-1]:
            found = parent.get(part)
            if not isinstance(found, dict):
                break
            # Copied on the way down: the document's own data stays as read.
            copied = dict(found)
            parent[part] = copied
            parent = copied
        else:
            table = parent.get(table_path[-1])
            if not isinstance(table, dict):
                continue
            misplaced = [name for name in table if name in own_keys]
            header = format_key(table_path)
            for name in misplaced:
                key = (*table_path, name)
                header_line = document.lines.get(table_path) or document.line_of(key)
                problems.append(
                    f"{document.where(key)}: {format_key(key)}: {what}, read as an entry of "
                    f"[{header}] because it follows that table (line {header_line}); {fix}"
                )
            parent[table_path[-1]] = {k: v for k, v in table.items() if k not in misplaced}
    return dataclasses.replace(document, data=data), problems


def header_blocked_reason(text: str) -> str | None:
    """The BLOCKED paragraph of the comment block at the top of a recipe file."""
    header: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        header.append(stripped.lstrip("#").strip())
    for start, line in enumerate(header):
        if "BLOCKED" in line:
            paragraph = []
            for following in header[start:]:
                if not following:
                    break
                paragraph.append(following)
            return " ".join(paragraph)
    return None


def recipe_id_for(path: Path) -> str:
    return path.parent.name if path.name == "recipe.toml" else path.stem


def load_recipe(path: Path) -> Recipe:
    """Load and check one recipe; raises RecipeError listing every problem, one per line."""
    document = load_toml(path, RecipeError)
    if "nodes" in document.data and "model" not in document.data:
        # Checked as a recipe, an inventory would be every one of its tables an unknown key.
        raise RecipeError(
            f"{document.where(('nodes',))}: nodes: this is a cluster inventory, not a recipe: "
            "move it to clusters/<name>.toml (sparkdeploy validate checks files in clusters/ as "
            "inventories); nothing else in it was checked"
        )
    checked, misplaced_problems = _without_misplaced_keys(document)
    validated = validate_document(checked, Recipe, secret_at=_secret_value_at(document.data))
    recipe = validated.value
    problems = misplaced_problems + validated.problems
    problems += recipe_problems(recipe, document.where, validated.broken)
    recipe.set_origin(recipe_id_for(path), path.parent, header_blocked_reason(document.text))
    if "composed_model" not in validated.broken:
        problems += _missing_ops_files(recipe, path.parent, document.where)
    if problems:
        raise RecipeError("\n".join(document.in_file_order(problems)))
    return recipe


def recipe_paths(recipes_dir: Path) -> list[Path]:
    return sorted(recipes_dir.glob("*/recipe.toml"))


def load_all_recipes(recipes_dir: Path) -> dict[str, Recipe]:
    """Every recipes/<name>/recipe.toml by name; all files' problems in one RecipeError."""
    recipes: dict[str, Recipe] = {}
    problems: list[str] = []
    for path in recipe_paths(recipes_dir):
        try:
            recipes[recipe_id_for(path)] = load_recipe(path)
        except RecipeError as exc:
            problems.append(str(exc))
    if problems:
        raise RecipeError("\n".join(problems))
    return recipes
