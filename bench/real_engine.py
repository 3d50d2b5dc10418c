"""Real vLLM (the CPU build) on the lab against the same engine started directly on the host.

On a 2-node lab with the real engine prepared (`lab real-engine`), the 2-node recipe
(recipes/real-lab-2x: mp, TP 2) is deployed once cold and torn down; then each round, in turn:

- host: the same `vllm serve` argv and environment the plan gives each node (the head's fabric
  address replaced by 127.0.0.1, the fabric netdev by lo), both ranks started as processes on
  the host; boot = processes started to /v1/models listing the served name.
- lab: a warm deploy through the deploy flow (smoke skipped: its requests are the engine's
  time, not the pipeline's); boot = containers started to /v1/models listing the served name
  (the gate's `endpoint_healthy`).

Prints per round and as medians: the boot ratio lab/host (target <= 1.15: containers, mounts and
the lab network must cost the engine next to nothing); the gate's delay from the head's
`Application startup complete.` to its own verdict on /health and /v1/models (target <= 1 s),
with the one test completion's time beside it (the engine's work); the warm redeploy's
orchestration overhead, the flow's wall time minus the engine's time to ready (target <= 5 s).
Runs against its own local Prefect server; needs root and a machine that runs the CPU build.

    .venv/bin/python -m bench.real_engine [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.cpu import measured
from lab.cluster import Lab
from lab.prefect_local import PROJECT_ROOT, PrefectServer, free_port
from lab.vllm_runtime import prepare_real_engine, unavailable_reason
from sparkdeploy.remote.engine_http import probe_endpoint
from sparkdeploy.spec.plan import Plan
from sparkdeploy.spec.project import load_plan

RECIPE = PROJECT_ROOT / "recipes" / "real-lab-2x" / "recipe.toml"
HOST_READY_TIMEOUT_S = 600.0
HOST_STOP_TIMEOUT_S = 30.0


def host_argv_and_env(
    plan: Plan, rank: int, python: Path, workdir: Path, api_port: int, master_port: int
) -> tuple[list[str], dict[str, str]]:
    """The plan's node `rank` as a host process: same serve argv and env, loopback addresses."""
    node = plan.nodes[rank]
    head_ip = plan.nodes[0].fabric_ip
    command = ["127.0.0.1" if arg == head_ip else arg for arg in node.container.command]
    command = [str(master_port) if arg == "29501" else arg for arg in command]
    if rank == 0:
        command += ["--port", str(api_port)]
    env = {
        **{k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "HOME")},
        **node.container.env,
        **{key: value.get_secret_value() for key, value in node.container.secret_env.items()},
        "VLLM_HOST_IP": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
        "TMPDIR": str(workdir),
        # Kept across runs, as the recipe keeps them on each node: warm runs on both sides.
        "VLLM_CACHE_ROOT": str(workdir.parent.parent / f"vllm-cache-rank{rank}"),
        "TORCHINDUCTOR_CACHE_DIR": str(workdir.parent.parent / f"inductor-rank{rank}"),
    }
    for key in ("UCX_NET_DEVICES",):
        env.pop(key, None)
    entry = [
        str(python),
        "-c",
        "import sys; from vllm.entrypoints.cli.main import main; "
        "sys.argv[0] = 'vllm'; sys.exit(main())",
    ]
    return [*entry, "serve", *command], env


def host_boot(plan: Plan, python: Path, workdir: Path) -> float:
    """Seconds from starting both ranks on the host to /v1/models listing the served name."""
    api_port, master_port = free_port(), free_port()
    processes = []
    started = time.monotonic()
    try:
        for rank in range(len(plan.nodes)):
            rank_dir = workdir / f"rank{rank}"
            rank_dir.mkdir(parents=True, exist_ok=True)
            argv, env = host_argv_and_env(plan, rank, python, rank_dir, api_port, master_port)
            log = (rank_dir / "serve.log").open("w")
            processes.append(
                subprocess.Popen(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        endpoint = f"http://127.0.0.1:{api_port}"
        while time.monotonic() - started < HOST_READY_TIMEOUT_S:
            if probe_endpoint(
                endpoint, plan.served_model_name, timeout=1.0, api_key=plan.api_key
            ).ready:
                return time.monotonic() - started
            if any(process.poll() is not None for process in processes):
                raise SystemExit(f"a host rank exited; see {workdir}/rank*/serve.log")
            time.sleep(0.2)
        raise SystemExit(f"the host engine was not ready in {HOST_READY_TIMEOUT_S} s")
    finally:
        for process in processes:
            os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=HOST_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    options = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    from flows.deploy import deploy
    from flows.teardown import teardown

    boot_ratios, gate_delays, completions, overheads = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-real-engine-") as scratch:
        workdir = Path(scratch)
        server = PrefectServer(workdir / "prefect", port=free_port())
        server.start()
        os.environ.update({k: v for k, v in server.env().items() if k.startswith("PREFECT_")})
        lab = Lab("benchreal", 2)
        lab.up()
        try:
            engine = prepare_real_engine(lab)
            cluster = str(lab.inventory_path)
            recipe = str(RECIPE.parent)
            plan = load_plan(recipe, cluster)
            deploy(recipe, cluster=cluster, skip=["smoke-test"])  # cold: prefetch, pull, compile
            teardown(recipe, cluster=cluster)
            host_boot(plan, engine.python, workdir / "host-warmup")  # the host's compile cache
            for round_number in range(1, options.rounds + 1):
                host_s = host_boot(plan, engine.python, workdir / f"host-{round_number}")
                with measured() as usage:
                    summary = deploy(recipe, cluster=cluster, skip=["smoke-test"])
                teardown(recipe, cluster=cluster)
                marks = summary.head_markers_s
                lab_s = marks["endpoint_healthy"]
                gate_delay = marks["endpoint_healthy"] - marks["application_ready"]
                completion = marks["endpoint_ready"] - marks["endpoint_healthy"]
                overhead = usage.wall_s - (summary.ready_after_s or 0.0)
                boot_ratios.append(lab_s / host_s)
                gate_delays.append(gate_delay)
                completions.append(completion)
                overheads.append(overhead)
                print(
                    f"  round {round_number}: boot host {host_s:.1f} s, lab {lab_s:.1f} s"
                    f" (ratio {lab_s / host_s:.3f}); gate delay after 'Application startup"
                    f" complete.' {gate_delay:.2f} s, test completion {completion:.2f} s;"
                    f" warm redeploy wall {usage.wall_s:.1f} s, engine ready"
                    f" {summary.ready_after_s:.1f} s, overhead {overhead:.2f} s; CPU"
                    f" {usage.busy_s:.1f} s, stolen by the hypervisor {usage.stolen_s:.2f} s",
                    flush=True,
                )
        finally:
            lab.down()
            server.stop()
    print(f"boot ratio lab/host: {statistics.median(boot_ratios):.3f} (median; target <= 1.15)")
    print(
        f"gate delay after 'Application startup complete.': "
        f"{statistics.median(gate_delays):.2f} s (median; target <= 1 s); the test completion "
        f"after it: {statistics.median(completions):.2f} s (the engine's)"
    )
    print(
        f"warm redeploy overhead beyond the engine's time to ready: "
        f"{statistics.median(overheads):.2f} s (median; target <= 5 s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
