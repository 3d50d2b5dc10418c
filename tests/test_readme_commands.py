"""Every command README.md shows is run here, or listed with the reason it is not: a command the
README gains that is neither fails test_every_readme_command_is_run_or_listed, so the README and
this file cannot drift apart.

A command is a line of one of README.md's ```sh blocks (a trailing backslash continues it, `#`
starts a comment), or a span in `backticks` elsewhere that starts with a program (sparkdeploy,
prefect, python, pytest, pip, cp, scripts/...) and is not just the start of a block's command
(`sparkdeploy plan` names the command the block shows in full) or a program's bare name.
`.venv/bin/` is not part of a command's identity.

The commands that need no cluster run as the README shows them, real names and all. Those that
need one run on the lab (test_the_readme_commands_on_the_lab, in the order ON_LAB lists them),
with the README's names for the real cluster replaced by the lab's:

    recipe dsv41-flash-eugr-0913-4x           -> lab-single: the README's benchmark measures
                                                 lab-single, so one deploy serves both
    recipe dsv41-flash-eugr-0920-4x           -> the copy of lab-single the README's `cp -r` makes,
                                                 in the test's tmp dir, not under recipes/
    deployment id dsv41-flash-eugr-0913-4x-1a2b3c4d -> the deployment id of that copy, which
                                                 this teardown removes (lab-single's own is
                                                 torn down by its recipe before the copy is
                                                 deployed, so the comparisons find the nodes
                                                 free)
    cluster dgx-spark-4, and `cluster=lab`    -> the test lab's inventory (the lab is named by
                                                 SPARKDEPLOY_TEST_LAB, not `lab`)
    `python -m lab image`, `models`           -> with `--name` the test lab's
    `prefect deploy`'s prefect.yaml           -> lab/prefect.yaml (`--prefect-file`), the same
                                                 deployments on the lab
    `sparkdeploy validate`'s project          -> recipes/ and images/ with the lab's dir as
                                                 clusters/: the real inventory's SSH key files
                                                 are not on this host
    the notification block slack-webhook/ops  -> a Slack webhook block `ops` on the test server,
                                                 its URL on loopback (nothing is sent)

Every command run must exit 0 (or the exit its --help documents: `diff` exits 1 when the recipes
differ), and a `prefect deployment run` must end Completed; where the README says what a command
prints, the output is checked loosely.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import redirect_stdout, suppress
from dataclasses import dataclass
from io import StringIO
from pathlib import Path

import pytest
from lab_flows import REPAIR_AUTOMATION, harness_env, wait_for_state

from lab.cluster import Lab
from lab.prefect_local import stop_worker
from sparkdeploy.report.notify import NOTIFY_AUTOMATION
from sparkdeploy.report.zombies import ZOMBIE_AUTOMATION

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
# The venv this test runs in: where the README's `.venv/bin/...` and `prefect` are.
VENV_BIN = Path(sys.executable).parent

Tokens = tuple[str, ...]


def shown(text: str) -> Tokens:
    """A command as sh splits it (quotes and comment off), its program without `.venv/bin/`."""
    tokens = shlex.split(text, comments=True)
    return tuple(token.removeprefix(".venv/bin/") for token in tokens)


def fenced_commands(markdown: str) -> list[Tokens]:
    blocks = re.findall(r"^```sh\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [tokens for line in lines if (tokens := shown(line))]


INLINE_COMMAND = re.compile(
    r"(?:\w+=\S*\s+)*(?:\.venv/bin/)?"  # environment, venv
    r"(?:sparkdeploy|prefect|python|pytest|pip|cp|scripts/\S+)(?:\s|$)"
)


def inline_commands(markdown: str, fenced: list[Tokens]) -> list[Tokens]:
    """The commands the README's prose shows in backticks, but for those that only name the
    start of a fenced command."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)
    commands = []
    for span in re.findall(r"`([^`]+)`", prose):
        text = " ".join(span.split())
        if not INLINE_COMMAND.match(text):
            continue
        tokens = shown(text)
        if len(tokens) == 1 and not tokens[0].startswith("scripts/"):
            continue  # a program named, not run
        if not any(command[: len(tokens)] == tokens for command in fenced):
            commands.append(tokens)
    return commands


def readme_commands() -> list[Tokens]:
    markdown = README.read_text()
    fenced = fenced_commands(markdown)
    return list(dict.fromkeys([*fenced, *inline_commands(markdown, fenced)]))


# --- Run as the README shows them: they need no cluster -------------------------------------


@dataclass
class Ran:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    def says(self) -> str:
        return f"{shlex.join(self.argv)} exited {self.returncode}:\n{self.stdout}\n{self.stderr}"


def run(
    argv: Iterable[str], env: Mapping[str, str] | None = None, *, timeout_s: float = 120
) -> Ran:
    """argv from the project root, its program from this test's venv."""
    argv = list(argv)
    program = VENV_BIN / argv[0]
    if program.exists():
        argv[0] = str(program)
    path = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    result = subprocess.run(
        argv,
        cwd=ROOT,
        env={**(env if env is not None else os.environ), "PATH": path, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    return Ran(argv, result.returncode, result.stdout, result.stderr)


def checked_no_problems(ran: Ran) -> None:
    assert ran.returncode == 0, ran.says()
    assert re.search(r"checked \d+ files: 0 problems", ran.stderr), ran.says()


def printed_docker_run_and_fit(ran: Ran) -> None:
    # "per node: docker run, and the memory fit when this host sees the model in the NAS cache"
    assert ran.returncode == 0, ran.says()
    assert "docker run" in ran.stdout, ran.says()
    assert "memory fit" in ran.stdout, ran.says()


def printed_plan_json(ran: Ran) -> None:
    assert ran.returncode == 0, ran.says()
    assert json.loads(ran.stdout)["deployment_id"].startswith("dsv41-flash-eugr-0913-4x-")


def printed_the_difference(ran: Ran) -> None:
    # `diff` exits 1 when the recipes differ (its --help), and these two do.
    assert ran.returncode == 1, ran.says()
    assert "--tensor-parallel-size: 1 -> 2" in ran.stdout, ran.says()


WITHOUT_A_CLUSTER: dict[str, Callable[[Ran], None]] = {
    ".venv/bin/sparkdeploy validate --no-check-files": checked_no_problems,
    ".venv/bin/sparkdeploy plan dsv41-flash-eugr-0913-4x --cluster dgx-spark-4": (
        printed_docker_run_and_fit
    ),
    ".venv/bin/sparkdeploy plan dsv41-flash-eugr-0913-4x --cluster dgx-spark-4 --json": (
        printed_plan_json
    ),
    ".venv/bin/sparkdeploy diff real-lab-1x real-lab-2x": printed_the_difference,
}


# --- Run on the lab -------------------------------------------------------------------------


@dataclass
class OnLab:
    """What a step of the lab test has: the lab's names, the server's environment, where the
    test's files go, and the worker it started."""

    lab: Lab
    inventory: str
    env: dict[str, str]
    tmp: Path
    worker: subprocess.Popen[bytes] | None = None

    @property
    def copy_of_the_recipe(self) -> Path:
        return self.tmp / "recipes" / "lab-single-0920"

    def names(self) -> dict[str, str]:
        """The README's real-cluster names and what they are on the lab (the module's
        docstring), for whole arguments and for the values of `-p NAME=VALUE`."""
        names = {
            "dsv41-flash-eugr-0913-4x": "lab-single",
            "recipes/dsv41-flash-eugr-0913-4x": "recipes/lab-single",
            "dsv41-flash-eugr-0920-4x": str(self.copy_of_the_recipe),
            "recipes/dsv41-flash-eugr-0920-4x": str(self.copy_of_the_recipe),
            "dgx-spark-4": self.inventory,
            "cluster=lab": f"cluster={self.inventory}",
        }
        if self.copy_of_the_recipe.exists():
            names["dsv41-flash-eugr-0913-4x-1a2b3c4d"] = self.deployment_id(
                str(self.copy_of_the_recipe)
            )
        return names

    def deployment_id(self, recipe: str) -> str:
        from sparkdeploy.spec.project import load_plan

        return load_plan(recipe, self.inventory).deployment_id

    def mapped(self, tokens: Tokens) -> list[str]:
        names = self.names()
        argv = []
        for token in tokens:
            key, equals, value = token.partition("=")
            if token in names:
                argv.append(names[token])
            elif equals and value in names:
                argv.append(f"{key}={names[value]}")
            else:
                argv.append(token)
        return argv


@dataclass(frozen=True)
class Step:
    """A README command run on the lab: `extra` arguments after it, `prepare` before it, `check`
    on what it did; a `background` one is started and left running."""

    readme: str
    check: Callable[[OnLab, Ran], None]
    extra: Callable[[OnLab], list[str]] = lambda on: []
    prepare: Callable[[OnLab], None] = lambda on: None
    timeout_s: float = 300
    background: bool = False


def succeeded(on: OnLab, ran: Ran) -> None:
    assert ran.returncode == 0, ran.says()


def printed_the_image(on: OnLab, ran: Ran) -> None:
    succeeded(on, ran)
    assert "lab/vllm-standin:latest" in ran.stdout, ran.says()


def printed_the_models(on: OnLab, ran: Ran) -> None:
    succeeded(on, ran)
    assert re.search(r": \d+ files, \d+ bytes", ran.stdout), ran.says()


def the_lab_named(on: OnLab) -> list[str]:
    return ["--name", on.lab.name]


def validated_with_the_labs_inventory(on: OnLab, ran: Ran) -> None:
    checked_no_problems(ran)


def project_with_the_labs_inventory(on: OnLab) -> None:
    """SPARKDEPLOY_ROOT for `validate`: this project's recipes/ and images/, the lab's dir (its
    inventory and the key files it names) as clusters/."""
    project = on.tmp / "project"
    project.mkdir()
    for name in ("recipes", "images"):
        (project / name).symlink_to(ROOT / name)
    (project / "clusters").symlink_to(Path(on.inventory).parent)
    on.env["SPARKDEPLOY_ROOT"] = str(project)


def without_the_project_override(on: OnLab) -> None:
    on.env.pop("SPARKDEPLOY_ROOT", None)


def previewed(on: OnLab, ran: Ran) -> None:
    # "what a deploy would do now, per step and node"; exit 3 would be a refusal.
    assert ran.returncode == 0, ran.says()
    for step in ("prefetch", "hold-nodes", "image", "boot"):
        assert step in ran.stdout, ran.says()


def no_pool_yet(on: OnLab) -> None:
    """The README creates the pool once, on a new server; the session's server may hold it
    from an earlier module (its workers are gone with that module)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client, suppress(ObjectNotFound):
        client.delete_work_pool("sparkdeploy")


def the_lab_prefect_file(on: OnLab) -> list[str]:
    return ["--prefect-file", "lab/prefect.yaml"]


def registered(on: OnLab, ran: Ran) -> None:
    """Registered, with the repair automation paused as tests/lab_flows.py does: an unhealthy
    event must not start a repair no test waits for."""
    from prefect.client.orchestration import get_client

    succeeded(on, ran)
    with get_client(sync_client=True) as client:
        for automation in client.read_automations_by_name(REPAIR_AUTOMATION):
            client.pause_automation(automation.id)


def watched_to_completion(on: OnLab, ran: Ran) -> None:
    assert ran.returncode == 0, ran.says()
    assert "Flow run finished successfully in 'Completed'" in ran.stdout, ran.says()


def flow_run_completed(on: OnLab, ran: Ran) -> None:
    """A `prefect deployment run` without --watch: its run, waited for, Completed."""
    succeeded(on, ran)
    found = re.search(r"UUID: ([0-9a-f-]{36})", ran.stdout)
    assert found, ran.says()
    state = wait_for_state(found.group(1), timeout_s=900)
    assert state.is_completed(), f"{ran.says()}\nended {state.name}: {state.message}"


def torn_down(on: OnLab, ran: Ran) -> None:
    from sparkdeploy.spec.cluster import load_cluster
    from sparkdeploy.steps.status import cluster_status

    flow_run_completed(on, ran)
    assert cluster_status(load_cluster(Path(on.inventory))) == []


def printed_the_deployment(on: OnLab, ran: Ran) -> None:
    # "lists each deployment with its health, uptime, last smoke test and last watchdog event"
    succeeded(on, ran)
    assert on.deployment_id("lab-single") in ran.stdout, ran.says()
    assert "healthy" in ran.stdout, ran.says()


def made_the_zombie_automation(on: OnLab, ran: Ran) -> None:
    try:
        succeeded(on, ran)
        assert "crashes flow runs silent for 90 s (heartbeats every 30 s)" in ran.stdout, ran.says()
    finally:
        # At once: the lab's flow runs beat every 180 s (Prefect's default), so a 90 s silence
        # would crash the runs after this one.
        remove_automations([ZOMBIE_AUTOMATION])


def an_ops_slack_webhook(on: OnLab) -> None:
    from prefect.blocks.notifications import SlackWebhook
    from pydantic import SecretStr

    # A URL on loopback (apprise logs that it cannot parse it as Slack's): nothing is sent.
    SlackWebhook(url=SecretStr("http://127.0.0.1:9/readme-test")).save("ops", overwrite=True)


def made_the_notification(on: OnLab, ran: Ran) -> None:
    try:
        succeeded(on, ran)
        assert "sends to slack-webhook/ops" in ran.stdout, ran.says()
    finally:
        remove_automations([NOTIFY_AUTOMATION])


def copied(on: OnLab, ran: Ran) -> None:
    succeeded(on, ran)
    assert (on.copy_of_the_recipe / "recipe.toml").is_file()


def a_dir_for_the_copy(on: OnLab) -> None:
    on.copy_of_the_recipe.parent.mkdir(parents=True, exist_ok=True)


DEPLOY_TIMEOUT_S = 900

# In this order: the setup the lab needs; the real-cluster block, with one deploy that the
# status, notification and benchmark commands share, torn down by its recipe; the replacing
# deploy of a copy, torn down by its deployment id; then the disk hygiene and the comparisons
# (each deploys and tears down its own sides, on nodes nothing holds).
ON_LAB: list[Step] = [
    Step(".venv/bin/python -m lab image", printed_the_image, extra=the_lab_named),
    Step(".venv/bin/python -m lab models", printed_the_models, extra=the_lab_named),
    Step(
        ".venv/bin/sparkdeploy validate",
        validated_with_the_labs_inventory,
        prepare=project_with_the_labs_inventory,
    ),
    Step(
        ".venv/bin/sparkdeploy plan dsv41-flash-eugr-0913-4x --cluster dgx-spark-4 --live",
        previewed,
        prepare=without_the_project_override,
    ),
    Step("prefect work-pool create sparkdeploy --type process", succeeded, prepare=no_pool_yet),
    Step("prefect deploy --all --no-prompt", registered, extra=the_lab_prefect_file),
    # Started, not waited for: the runs after it need it (stopped after the test).
    Step("prefect worker start --pool sparkdeploy", succeeded, background=True),
    Step(
        "prefect deployment run 'deploy/deploy' -p recipe=dsv41-flash-eugr-0913-4x"
        " -p cluster=dgx-spark-4 --watch",
        watched_to_completion,
        timeout_s=DEPLOY_TIMEOUT_S,
    ),
    Step("sparkdeploy status dgx-spark-4", printed_the_deployment),
    Step("sparkdeploy zombies --heartbeat-s 30", made_the_zombie_automation),
    Step(
        "sparkdeploy notify slack-webhook/ops",
        made_the_notification,
        prepare=an_ops_slack_webhook,
    ),
    Step(
        "prefect deployment run 'benchmark/benchmark' -p recipe=lab-single -p cluster=lab --watch",
        watched_to_completion,
        timeout_s=DEPLOY_TIMEOUT_S,
    ),
    Step(
        "prefect deployment run 'teardown/teardown' -p recipe=dsv41-flash-eugr-0913-4x"
        " -p cluster=dgx-spark-4",
        torn_down,
    ),
    Step(
        "cp -r recipes/dsv41-flash-eugr-0913-4x recipes/dsv41-flash-eugr-0920-4x",
        copied,
        prepare=a_dir_for_the_copy,
    ),
    Step(
        "prefect deployment run 'deploy/deploy' -p recipe=dsv41-flash-eugr-0920-4x"
        " -p cluster=dgx-spark-4 -p replace=true --watch",
        watched_to_completion,
        timeout_s=DEPLOY_TIMEOUT_S,
    ),
    Step(
        "prefect deployment run 'teardown/teardown'"
        " -p deployment_id=dsv41-flash-eugr-0913-4x-1a2b3c4d -p cluster=dgx-spark-4",
        torn_down,
    ),
    Step("prefect deployment run 'prune/nightly' -p cluster=dgx-spark-4", flow_run_completed),
    Step(
        "prefect deployment run 'prune/nightly' -p cluster=dgx-spark-4 -p dry_run=false",
        flow_run_completed,
    ),
    Step(
        "prefect deployment run 'compare/compare' -p cluster=lab"
        """ -p side_a='{"recipe": "lab-single"}'"""
        """ -p side_b='{"recipe": "lab-single", "args": ["--max-num-seqs", "4"]}'"""
        """ -p settings='{"concurrency": [1, 4], "input_tokens": 64, "output_tokens": 32}'"""
        " -p noise_floor=0.5 -p latency_floor_ms=10 --watch",
        watched_to_completion,
        timeout_s=DEPLOY_TIMEOUT_S,
    ),
    Step(
        "prefect deployment run 'compare/compare' -p cluster=lab -p placement=sequential"
        """ -p side_a='{"recipe": "lab-single", "revision": "HEAD~3"}'"""
        """ -p side_b='{"recipe": "lab-single"}'""",
        flow_run_completed,
    ),
]


# --- Not run, and why ----------------------------------------------------------------------

NOT_RUN: dict[str, str] = {
    "scripts/demo": "installs Debian packages and the venv (scripts/setup), then brings up a lab"
    " and a Prefect server of its own on fixed ports; the commands it runs are the lab's image,"
    " models, deploy --all, worker and deploy run here",
    "scripts/demo --real": "scripts/demo with real vLLM's CPU build; tests/test_real_engine.py"
    " deploys real-lab-2x through a worker",
    "scripts/demo --postgres": "scripts/demo on PostgreSQL; scripts/test runs the flow tests on"
    " it (SPARKDEPLOY_TEST_DATABASE=postgresql)",
    "scripts/demo down": "stops what scripts/demo started, by the PIDs it recorded",
    "scripts/test": "the whole suite, this file included",
    "scripts/setup": "installs Debian packages and the venv",
    "pip install -e '.[team]'": "installs; scripts/setup installs the dev extra, which holds team",
    "pip install .": "installs the wheel; tests/test_packaging.py builds it",
    "prefect server start --keep-alive-timeout 30": "the session's Prefect server (conftest's"
    " prefect_harness, with the same keep-alive) stands in for it",
    "prefect server start --no-services": "a team's API server: tests/test_team.py runs two",
    "prefect server services start": "a team's services: tests/test_team.py runs them",
    "prefect server database upgrade -y": "upgrades a team's database",
    "prefect flow-run cancel": "needs a run to cancel: tests/test_fault_matrix_worker.py"
    " cancels a deploy mid-boot",
    "prefect deployment schedule ls deploy/ensure-dsv41": "deploy/ensure-dsv41 is prefect.yaml's,"
    " for the real cluster; the lab's scheduled ensure deploy is tests/test_keepup_lab.py's",
    "prefect deployment schedule resume deploy/ensure-dsv41 SCHEDULE_ID": "as its `ls`",
    ".venv/bin/python -m lab up [--nodes N] [--ops-hosts N] [--name NAME]": "the session's lab"
    " (conftest's lab_cluster) is brought up by Lab.up, which this runs; a second lab would"
    " double the machine's load",
    ".venv/bin/python -m lab up --brownfield": "tests/test_brownfield_lab.py brings up a"
    " brownfield lab of its own",
    ".venv/bin/python -m lab real-engine": "installs real vLLM's CPU build (minutes, GBs);"
    " tests/test_real_engine.py prepares it (the real_engine fixture)",
    ".venv/bin/python -m lab down": "would take the session's lab from the tests after this"
    " file; lab_cluster runs Lab.down at the session's end",
    "sparkdeploy plan RECIPE --cluster C --live": "placeholders: the `plan ... --live` of the"
    " real-cluster block runs on the lab",
    "SPARKDEPLOY_TEST_LAB=NAME .venv/bin/pytest tests/test_fault_matrix_*.py": "the fault"
    " matrix, part of the suite",
    "python -m bench.NAME": "a placeholder for the benchmarks, run by hand (minutes each)",
}


def test_every_readme_command_is_run_or_listed() -> None:
    accounted = [
        *map(shown, WITHOUT_A_CLUSTER),
        *(shown(step.readme) for step in ON_LAB),
        *map(shown, NOT_RUN),
    ]
    assert len(accounted) == len(set(accounted)), "a command is listed twice"
    in_readme = readme_commands()
    assert [shlex.join(c) for c in in_readme if c not in accounted] == [], (
        "README.md shows commands this file neither runs nor lists: run each (WITHOUT_A_CLUSTER"
        " or ON_LAB) or list it in NOT_RUN with the reason"
    )
    assert [shlex.join(c) for c in accounted if c not in in_readme] == [], (
        "commands this file runs or lists that README.md no longer shows"
    )


@pytest.mark.parametrize("readme", list(WITHOUT_A_CLUSTER))
def test_the_commands_that_need_no_cluster(readme: str) -> None:
    WITHOUT_A_CLUSTER[readme](run(shown(readme)))


def help_of(tokens: Tokens) -> str | None:
    """The --help of the (sub)command of ours `tokens` runs, or None when it is not ours."""
    from typer.testing import CliRunner

    if tokens[0] == "sparkdeploy":
        from sparkdeploy.cli import app

        result = CliRunner().invoke(app, [tokens[1], "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        return result.output
    if tokens[:3] == ("python", "-m", "lab"):
        from lab.__main__ import main as lab_main

        return argparse_help(lambda: lab_main([tokens[3], "--help"]))
    if tokens[0] == "scripts/demo":
        from lab.demo import main as demo_main

        return argparse_help(lambda: demo_main(["--help"]))
    return None


def argparse_help(main: Callable[[], object]) -> str:
    printed = StringIO()
    with redirect_stdout(printed), pytest.raises(SystemExit):
        main()
    return printed.getvalue()


def test_every_flag_the_readme_gives_our_commands_exists() -> None:
    """The commands of ours the README shows, run or not: each --flag is in its --help."""
    missing = []
    for tokens in readme_commands():
        helped = help_of(tokens)
        if helped is None:
            continue
        flags = {
            token.strip("[]").split("=")[0] for token in tokens if token.startswith(("--", "[--"))
        }
        missing += [f"{shlex.join(tokens)}: {flag}" for flag in sorted(flags) if flag not in helped]
    assert missing == []


# Paths under the project's top directories in the README's text.
README_PATH = re.compile(
    r"(?<![\w/.~-])((?:sparkdeploy|flows|tasks|lab|tests|bench|scripts|docs|recipes|clusters"
    r"|images)/[\w./*-]*[\w*])"
)
# What reads as such a path and is not one.
NOT_PATHS = {
    "bench/NAME.py": "a placeholder",
    "lab/tiny-llama-chat": "a model repo in the lab's hub",
    "lab/vllm-cpu": "an image in the lab's registry",
    "recipes/dsv41-flash-eugr-0920-4x": "the copy the README makes",
}


def test_every_path_the_readme_names_exists() -> None:
    named = set(README_PATH.findall(README.read_text()))
    missing = sorted(path for path in named - set(NOT_PATHS) if not list(ROOT.glob(path)))
    assert missing == []
    assert sorted(set(NOT_PATHS) - named) == [], "NOT_PATHS names what README.md no longer says"


@pytest.mark.lab
def test_the_readme_commands_on_the_lab(
    lab_cluster: Lab,
    cluster: str,
    prefect_harness: Path,
    clean_lab_after: None,
    tmp_path: Path,
) -> None:
    on = OnLab(
        lab=lab_cluster,
        inventory=cluster,
        env={
            **harness_env(prefect_harness),
            # The worker picks runs up within a second (the default polls every 10 s).
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            # The compare flow's recipe variants, in the test's dir.
            "SPARKDEPLOY_VARIANTS_DIR": str(tmp_path / "variants"),
        },
        tmp=tmp_path,
    )
    try:
        for step in ON_LAB:
            step.prepare(on)
            argv = [*on.mapped(shown(step.readme)), *step.extra(on)]
            if step.background:
                on.worker = start_logged(argv, on.env, tmp_path / "worker.log")
                continue
            started = time.monotonic()
            step.check(on, run(argv, on.env, timeout_s=step.timeout_s))
            # In the output of a failed test (or with -rP): what ran before, and how long.
            print(f"{time.monotonic() - started:6.1f} s  {shlex.join(argv)}")
    except BaseException:
        if (tmp_path / "worker.log").exists():
            print((tmp_path / "worker.log").read_text()[-5000:])
        raise
    finally:
        if on.worker is not None:
            stop_worker(on.worker)
        # Where a command of the two timed out before its check removed what it made.
        remove_automations([ZOMBIE_AUTOMATION, NOTIFY_AUTOMATION])


def start_logged(argv: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    program = VENV_BIN / argv[0]
    with open(log, "ab") as output:
        return subprocess.Popen(
            [str(program) if program.exists() else argv[0], *argv[1:]],
            env={**env, "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"},
            cwd=ROOT,
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def remove_automations(names: Iterable[str]) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for name in names:
            for automation in client.read_automations_by_name(name):
                client.delete_automation(automation.id)
