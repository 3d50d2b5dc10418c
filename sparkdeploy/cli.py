"""`sparkdeploy validate`, `plan` and `diff`: check files, show plans, compare recipes, touching
no node; `status`: what runs on a cluster; `notify`: the unhealthy-deployment notification.

Imports stay light (no prefect, paramiko, docker or huggingface_hub at module level) so
validating every recipe takes well under a second after start-up; status and notify import
what they need when they run.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from sparkdeploy.errors import FitError, SparkDeployError
from sparkdeploy.report.recipe_diff import diff_recipes
from sparkdeploy.secrecy import MASK
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import NodePlan, Plan
from sparkdeploy.spec.project import (
    find_cluster,
    find_image_dir,
    find_recipe,
    image_dir_fix,
    load_plan,
    missing_image_dir_problem,
)
from sparkdeploy.spec.recipe_loading import load_recipe, recipe_paths
from sparkdeploy.steps.fit import fit_report
from sparkdeploy.vllm.args import is_flag

if TYPE_CHECKING:
    from uuid import UUID

    from prefect.client.orchestration import SyncPrefectClient

app = typer.Typer(
    help="Validate recipes and cluster inventories; show what a deployment would run; compare "
    "two recipes; show what runs, and tell someone when it fails.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# The width of the status table when its output is not a terminal (a pipe, a log): a table
# wrapped to 80 columns would read as fragments.
STATUS_WIDTH_PIPED = (160, 24)

RootOption = Annotated[
    Path,
    typer.Option(
        "--root",
        envvar="SPARKDEPLOY_ROOT",
        help="Project directory holding recipes/ and clusters/.",
    ),
]


def _is_inventory(path: Path) -> bool:
    return path.parent.name == "clusters"


def _default_paths(root: Path) -> list[Path]:
    return recipe_paths(root / "recipes") + sorted((root / "clusters").glob("*.toml"))


def _missing_problem(path: Path, root: Path) -> str:
    """A path to check that does not exist, with the files that do."""
    if _is_inventory(path):
        known = ", ".join(
            inventory.stem
            for inventory in sorted(path.parent.glob("*.toml"))
            if inventory.is_file()
        )
        return f"{path}: does not exist (inventories in {path.parent}: {known or 'none'})"
    known = ", ".join(recipe.parent.name for recipe in recipe_paths(root / "recipes"))
    return (
        f"{path}: does not exist (recipes under {root / 'recipes'}: {known or 'none'}); name a "
        "recipe dir or file, or an inventory clusters/<name>.toml"
    )


def _problems_of(path: Path, check_files: bool, root: Path) -> list[str]:
    # A directory named *.toml is a mistaken inventory or recipe file, not a recipe dir.
    if path.is_dir() and path.suffix != ".toml":
        path = path / "recipe.toml"
    if not path.exists():
        return [_missing_problem(path, root)]
    try:
        if _is_inventory(path):
            cluster = load_cluster(path)
            return cluster.missing_files() if check_files else []
        missing_dir = missing_image_dir_problem(path, load_recipe(path), root)
    except SparkDeployError as exc:
        return str(exc).splitlines()
    return [missing_dir] if missing_dir else []


@app.command()
def validate(
    paths: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Recipe files or dirs and inventories (files in a clusters/ dir). "
            "Default: recipes/*/recipe.toml and clusters/*.toml."
        ),
    ] = None,
    check_files: Annotated[
        bool,
        typer.Option(
            "--check-files/--no-check-files",
            help="Check that inventories' identity files and known_hosts exist on this host.",
        ),
    ] = True,
    root: RootOption = Path("."),
) -> None:
    """Check recipes and inventories; print one line per problem; exit 1 on any.

    A recipe's docker_image_dir must be a build context under the root's images/.
    """
    targets = list(paths) if paths else _default_paths(root)
    problems = [line for path in targets for line in _problems_of(path, check_files, root)]
    for line in problems:
        typer.echo(line)
    typer.echo(f"checked {len(targets)} files: {len(problems)} problems", err=True)
    if problems or not targets:
        raise typer.Exit(1)


def _grouped(tokens: list[str]) -> list[str]:
    """Shell-quoted lines: each flag with its value, for people to read."""
    lines: list[str] = []
    index = 0
    while index < len(tokens):
        group = [tokens[index]]
        takes_value = is_flag(tokens[index]) and "=" not in tokens[index]
        if takes_value and index + 1 < len(tokens) and not is_flag(tokens[index + 1]):
            group.append(tokens[index + 1])
        lines.append(shlex.join(group))
        index += len(group)
    return lines


def _docker_run_text(node: NodePlan) -> str:
    spec = node.container
    argv = spec.docker_run_argv()
    image_at = len(argv) - len(spec.command) - len(spec.entrypoint[1:]) - 1
    options = _grouped(argv[3:image_at])
    if spec.secret_env:
        # boot writes them to a 0600 file on the node, removed once `docker run` returns
        hidden = " ".join(f"{key}={MASK}" for key in spec.secret_env)
        options.append(f"--env-file <0600 file: {hidden}>")
    program = argv[image_at:]
    head = 1
    while head < len(program) and not is_flag(program[head]):
        head += 1
    lines = ["docker run -d", *options, shlex.join(program[:head]), *_grouped(program[head:])]
    return " \\\n    ".join(lines)


def _fit_text(plan: Plan, unchecked: str | None) -> list[str]:
    if plan.fit is None:
        return [f"# memory fit not checked here ({unchecked}); a deploy checks it after prefetch"]
    report = plan.fit
    lines = [f"# memory fit of {report.summary_line()}", *(f"#   {row}" for row in report.table())]
    lines += [f"# note: {note}" for note in report.notes]
    lines += [f"# WARNING: {warning}" for warning in report.warnings]
    if report.refusal is not None:
        lines.append("# DOES NOT FIT (a deploy refuses to start):")
        lines += [f"#   {line}" for line in report.refusal.splitlines()]
    return lines


def _with_fit(plan: Plan) -> tuple[Plan, str | None]:
    """The plan with the fit check's figures when this host sees the model in the NAS cache,
    else why not."""
    try:
        return plan.model_copy(update={"fit": fit_report(plan)}), None
    except FitError as exc:
        return plan, str(exc)


def _image_text(plan: Plan, root: Path) -> list[str]:
    if plan.docker_image_dir is None:
        return [f"# image {plan.docker_image}: pulled on the nodes that lack it"]
    if find_image_dir(plan.docker_image_dir, root) is not None:
        return [f"# image {plan.docker_image}: built from images/{plan.docker_image_dir}"]
    return [
        f"# WARNING: images/{plan.docker_image_dir} is not here, so {plan.docker_image} cannot be"
        " built: a deploy uses it only if every node holds it with one image ID, and refuses"
        f" before the prefetch otherwise; {image_dir_fix(plan.docker_image_dir, plan.docker_image)}"
    ]


def _plan_text(plan: Plan, fit_unchecked: str | None, root: Path) -> str:
    out = [
        f"# deployment {plan.deployment_id}: recipe {plan.recipe} on cluster {plan.cluster}",
        f"# endpoint {plan.endpoint}  served model {plan.served_model_name}  "
        f"readiness timeout {plan.readiness_timeout_s:g} s"
        + (f"  API key {MASK}" if plan.api_key else ""),
        "# prefetch into "
        + plan.nas_hf_cache
        + ": "
        + ", ".join(f"{r.repo}@{r.revision or 'main'}" for r in plan.repos),
    ]
    if plan.blocked:
        out.insert(1, f"# BLOCKED (a deploy refuses to start): {plan.blocked}")
    out += _image_text(plan, root)
    out += _fit_text(plan, fit_unchecked)
    out += [
        f"# local file {posixpath.basename(decided.dest)}: {decided.kind} ({decided.why})"
        for decided in plan.local_files
    ]
    for node in plan.nodes:
        ssh = node.ssh
        out += [
            "",
            f"# node {node.node}: rank {node.rank} ({node.role}), ssh {ssh.user}@{ssh.host}:"
            f"{ssh.port}, tp ranks {node.tp_ranks}",
        ]
        if node.composed:
            out.append(f"# composed model dir {node.composed.root} -> {node.composed.mount}")
        out += [
            f"# engram stage {stage.filename} of {stage.repo.repo} -> {stage.dest} "
            f"(ranks {stage.ranks} of {stage.tp_size})"
            for stage in node.engram
        ]
        out += [
            f"# plain file {stage.filename} from "
            + (f"{stage.repo.repo} in the NAS" if stage.repo else f"{stage.ops_file} (ops host)")
            + f" -> {stage.dest}"
            for stage in node.plain
        ]
        out.append(_docker_run_text(node))
    return "\n".join(out)


def _node_names(nodes: str | None) -> list[str] | None:
    """--nodes as a list of names; an empty item (`--nodes ,`, `n1,,n2`) is refused, since
    taking it as no selection would deploy onto other nodes than the ones meant."""
    if nodes is None:
        return None
    names = [name.strip() for name in nodes.split(",")]
    if not all(names):
        raise SparkDeployError(
            f"--nodes {nodes!r} has an empty node name: name each node, comma-separated in rank "
            "order (--nodes n1,n2), or leave out --nodes to take the first nodes listed"
        )
    return names


@app.command()
def plan(
    recipe: Annotated[str, typer.Argument(help="A recipe name under recipes/ or a path.")],
    cluster: Annotated[
        str,
        typer.Option(
            "--cluster", help="An inventory name (clusters/NAME.toml, a lab's) or a path."
        ),
    ],
    nodes: Annotated[
        str | None, typer.Option("--nodes", help="Nodes in rank order, comma-separated.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    live: Annotated[
        bool,
        typer.Option(
            "--live",
            help="Read the cluster (NAS, hub, node locks, nodes), changing nothing, and print"
            " what a deploy would do now, per step and node, with bytes and expected times.",
        ),
    ] = False,
    replace: Annotated[
        bool, typer.Option("--replace", help="With --live: preview a deploy with replace=true.")
    ] = False,
    update_revisions: Annotated[
        bool,
        typer.Option(
            "--update-revisions", help="With --live: preview a deploy with update_revisions=true."
        ),
    ] = False,
    root: RootOption = Path("."),
) -> None:
    """Print what a deployment would run on each node (never runs it); with --live, what a
    deploy would do now (reads the cluster, changes nothing)."""
    try:
        result = load_plan(recipe, cluster, _node_names(nodes), root)
    except SparkDeployError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    if live:
        _live_preview(result, cluster, root, as_json, replace, update_revisions)
        return
    result, fit_unchecked = _with_fit(result)
    typer.echo(
        result.model_dump_json(indent=2) if as_json else _plan_text(result, fit_unchecked, root)
    )


def _live_preview(
    plan: Plan, cluster: str, root: Path, as_json: bool, replace: bool, update_revisions: bool
) -> None:
    """The preview of a deploy of `plan` (sparkdeploy.steps.preview), from this host: the hub
    token from HF_TOKEN, the node locks from the Prefect server PREFECT_API_URL names."""
    import json
    import os

    from sparkdeploy.remote import ssh
    from sparkdeploy.steps.prefetch import PUBLIC_HUB, HubAccess
    from sparkdeploy.steps.preview import preview

    hub = HubAccess(
        endpoint=plan.hub_endpoint or os.environ.get("HF_ENDPOINT") or PUBLIC_HUB,
        token=os.environ.get("HF_TOKEN") or None,
        token_source="HF_TOKEN",
        allow_http_token=plan.hub_allow_http_token,
    )
    try:
        found = preview(
            plan,
            load_cluster(find_cluster(cluster, root)),
            hub,
            replace=replace,
            update_revisions=update_revisions,
        )
    except SparkDeployError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    finally:
        ssh.close_cached()
    typer.echo(json.dumps(found.as_json(), indent=2) if as_json else found.markdown())
    if found.refusals:
        raise typer.Exit(3)


@app.command()
def diff(
    recipe_a: Annotated[str, typer.Argument(help="A recipe name under recipes/ or a path.")],
    recipe_b: Annotated[str, typer.Argument(help="The recipe to compare it with.")],
    root: RootOption = Path("."),
) -> None:
    """Print what differs between two recipes as the engine will see it: normalised flags,
    env (secrets as ***), image, mounts. Exit 0 when nothing differs, 1 when something does,
    2 when a recipe cannot be read."""
    try:
        recipes = [load_recipe(find_recipe(name, root)) for name in (recipe_a, recipe_b)]
    except SparkDeployError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    result = diff_recipes(*recipes, a_name=recipe_a, b_name=recipe_b)
    typer.echo(result.text())
    raise typer.Exit(0 if result.same else 1)


@app.command()
def status(
    cluster: Annotated[
        str, typer.Argument(help="An inventory name (clusters/NAME.toml, a lab's) or a path.")
    ],
) -> None:
    """Each deployment of ours on the cluster, as a table: health, healthy since, the sentinel's
    last probe, last fault and its cause, repairs this hour, last smoke test (from the Prefect
    server PREFECT_API_URL names) and bytes on each node."""
    import shutil
    from datetime import UTC, datetime

    from prefect import get_client

    from sparkdeploy.spec.project import find_cluster
    from sparkdeploy.steps.status_view import read_status

    try:
        inventory = load_cluster(find_cluster(cluster))
        with get_client(sync_client=True) as client:
            report = read_status(inventory, client, datetime.now(UTC))
    except SparkDeployError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    typer.echo(report.text(shutil.get_terminal_size(STATUS_WIDTH_PIPED).columns))


@app.command()
def notify(
    block: Annotated[
        str,
        typer.Argument(
            help="The notification block, BLOCK_TYPE/BLOCK_NAME as `prefect block ls` lists it."
        ),
    ],
) -> None:
    """Create or update the automation that sends each unhealthy-deployment event of the
    watchdog, with its cause, through the given notification block."""
    from sparkdeploy.report.notify import NOTIFY_AUTOMATION, apply_notify_automation

    automation_id = _apply_automation(lambda client: apply_notify_automation(client, block))
    typer.echo(f"automation {NOTIFY_AUTOMATION!r} ({automation_id}) sends to {block}")


@app.command()
def zombies(
    heartbeat_s: Annotated[
        int | None,
        typer.Option(
            help="The workers' PREFECT_FLOWS_HEARTBEAT_FREQUENCY (Prefect's default 180); a run"
            " three heartbeats silent is marked Crashed."
        ),
    ] = None,
) -> None:
    """Create or update the automation that marks a flow run Crashed when its heartbeats stop
    (its worker or host died), so the node locks of a deploy it was running can be taken over."""
    from sparkdeploy.report.zombies import (
        DEFAULT_HEARTBEAT_S,
        MISSED_HEARTBEATS,
        ZOMBIE_AUTOMATION,
        apply_zombie_automation,
    )

    every_s = DEFAULT_HEARTBEAT_S if heartbeat_s is None else heartbeat_s
    automation_id = _apply_automation(lambda client: apply_zombie_automation(client, every_s))
    typer.echo(
        f"automation {ZOMBIE_AUTOMATION!r} ({automation_id}) crashes flow runs silent for"
        f" {MISSED_HEARTBEATS * every_s} s (heartbeats every {every_s} s)"
    )


def _apply_automation(apply: Callable[[SyncPrefectClient], UUID]) -> UUID:
    """apply's automation created or updated through a Prefect client; its refusal on stderr,
    exit 1."""
    from prefect import get_client

    try:
        with get_client(sync_client=True) as client:
            return apply(client)
    except SparkDeployError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
