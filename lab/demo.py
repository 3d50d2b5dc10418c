"""The newcomer's main job: the whole pipeline on the lab, through Prefect, with one command.

`python -m lab.demo` (what `scripts/demo` runs): the 3-node lab up, the engine image and the lab
models published, a local Prefect server (SQLite under .prefect/) and a process worker started,
the deployments registered, then `prefect deployment run 'deploy/deploy'` of the DSV4.1-shaped
lab recipe (with `--real`: real vLLM's CPU build, two nodes, tensor parallel 2; its runtime, image
and model are installed first, once per machine). It prints the endpoint, a sample answer and the
run's UI address, and leaves the deployment, the server and the worker running for a look around,
with a scheduled deploy of the same recipe with ensure semantics (every ENSURE_INTERVAL_S: a
smoke test while it serves, a redeploy when it does not).
`python -m lab.demo down` stops all of it (by the PIDs recorded in .prefect/demo.json) and tears
the lab down.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from lab.chat_model import CHAT_MODEL_REPO
from lab.cluster import Lab
from lab.image import build_engine_image
from lab.models import publish_lab_models
from lab.postgres import PostgresServer
from lab.prefect_local import (
    PROJECT_ROOT,
    PrefectServer,
    deploy_run,
    register_deployments,
    register_ensure,
    resume_schedules,
    start_worker,
)
from lab.testing.engine_chat import answer_text, chat
from lab.vllm_runtime import prepare_real_engine
from sparkdeploy.errors import SparkDeployError
from sparkdeploy.spec.project import lab_root, load_plan
from sparkdeploy.steps.smoke_test import CANARIES

DEMO_RECIPE = "lab-dsv41-3x"
REAL_DEMO_RECIPE = "real-lab-2x"
LAB_NAME = "lab"
PREFECT_HOME = PROJECT_ROOT / ".prefect"
STATE_FILE = PREFECT_HOME / "demo.json"
SERVER_PORT = 4200
DATABASE_PORT = 5433
DEPLOY_TIMEOUT_S = 900.0
ENSURE_INTERVAL_S = 600


def _say(message: str) -> None:
    print(f"demo: {message}", flush=True)


def _stop_recorded() -> None:
    """Stop the server and worker a previous demo left running, by their recorded PIDs."""
    try:
        state = json.loads(STATE_FILE.read_text())
    except FileNotFoundError:
        return
    for what in ("worker", "server", "database"):
        pid = state.get(what)
        if not pid:
            continue
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.killpg(pid, signal.SIGKILL)
        _say(f"stopped the {what} (pid {pid})")
    STATE_FILE.unlink()


def _start_database() -> PostgresServer:
    """The demo's PostgreSQL (its cluster kept under the lab root between demos, as the SQLite
    file is under .prefect/), and a database `prefect` in it."""
    database = PostgresServer(lab_root() / "postgres" / "demo", port=DATABASE_PORT)
    database.start()
    database.create_database("prefect")
    return database


def up(*, real: bool = False, postgres: bool = False) -> int:
    _stop_recorded()
    started = time.monotonic()
    recipe = REAL_DEMO_RECIPE if real else DEMO_RECIPE
    lab = Lab(LAB_NAME, 3)
    _say(f"lab {LAB_NAME!r} up in {lab.up():.1f} s: nodes {', '.join(lab.nodes)}")
    _say(f"engine image {build_engine_image(lab)} in the lab registry {lab.registry}")
    models = list(publish_lab_models(lab.hub_repos_dir))
    if real:
        _say("real vLLM: runtime, image and model (the first time: ~5 min, 3 GB of disk)")
        engine = prepare_real_engine(lab, progress=_say)
        models.append(CHAT_MODEL_REPO)
        _say(f"real engine image {engine.image}; runtime {engine.runtime}")
    _say(f"lab hub {lab.hub_url} serves {', '.join(models)}")

    pids: dict[str, int | None] = {}
    PREFECT_HOME.mkdir(exist_ok=True)
    database_url = None
    if postgres:
        database = _start_database()
        pids["database"] = database.pid
        STATE_FILE.write_text(json.dumps(pids))
        database_url = database.database_url("prefect")
        where = f"PostgreSQL {database_url} (data in {database.data_dir})"
    else:
        where = f"SQLite in {PREFECT_HOME}"
    server = PrefectServer(PREFECT_HOME, port=SERVER_PORT, database_url=database_url)
    _say(f"starting the Prefect server ({server.ui_url}, {where})")
    server.start()
    pids["server"] = server.pid
    STATE_FILE.write_text(json.dumps(pids))
    register_deployments(server.env())
    resume_schedules(server.env(), "sentinel/lab")
    worker = start_worker(server.env(), PREFECT_HOME / "worker.log")
    pids["worker"] = worker.pid
    STATE_FILE.write_text(json.dumps(pids))
    _say("deployments registered; worker started (log: .prefect/worker.log)")

    _say(f"prefect deployment run 'deploy/deploy' -p recipe={recipe} -p cluster={LAB_NAME}")
    flow_run_id = deploy_run(server.env(), recipe, LAB_NAME, watch_timeout_s=DEPLOY_TIMEOUT_S)
    run_url = f"{server.ui_url}/runs/flow-run/{flow_run_id}"
    ensure = register_ensure(server.env(), recipe, LAB_NAME, interval_s=ENSURE_INTERVAL_S)
    _say(f"{ensure} keeps it up: every {ENSURE_INTERVAL_S} s a smoke test, a redeploy if need be")
    plan = load_plan(recipe, LAB_NAME)
    answer = answer_text(
        chat(plan.endpoint, plan.served_model_name, CANARIES[0].prompt, timeout_s=30, temperature=0)
    )
    print(
        f"\nDeployed {recipe} on lab nodes {', '.join(n.node for n in plan.nodes)} in "
        f"{time.monotonic() - started:.0f} s.\n"
        f"  endpoint:  {plan.endpoint} (model {plan.served_model_name!r})\n"
        f"  asked:     {CANARIES[0].prompt}\n"
        f"  answered:  {answer}\n"
        f"  the run:   {run_url}\n"
        f"  Prefect:   {server.ui_url}\n"
        "Tear it all down with: scripts/demo down",
        flush=True,
    )
    return 0


def down() -> int:
    _stop_recorded()
    _say(f"lab {LAB_NAME!r} down in {Lab(LAB_NAME).down():.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.demo", description=__doc__)
    parser.add_argument("command", nargs="?", choices=("up", "down"), default="up")
    parser.add_argument(
        "--real",
        action="store_true",
        help="deploy real vLLM (CPU build, 2 nodes, TP 2) instead of the stand-in",
    )
    parser.add_argument(
        "--postgres",
        action="store_true",
        help="the Prefect server on PostgreSQL (started here, data kept under the lab root)"
        " instead of SQLite, as a team runs it",
    )
    options = parser.parse_args(argv)
    try:
        if options.command == "down":
            return down()
        return up(real=options.real, postgres=options.postgres)
    except SparkDeployError as error:
        print(f"demo: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
