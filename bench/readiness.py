"""How long after the engine's last boot marker the readiness gate says ready.

    python -m bench.readiness [--rounds 5]

Each round boots the engine stand-in (lab/engine/vllm_standin.py) as a local process on
127.0.0.1 with a lab.tinymodel HF cache, feeds its stdout to the gate as `docker logs -f` would,
and takes the delay between the moment its `Application startup complete.` line was read and
the gate's ready time (markers complete, then GET /health and /v1/models). Target from issue 5:
readiness noticed <= 1 s after the engine's last marker.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from lab.layout import REPO_ROOT
from lab.processes import stop_process_group
from lab.testing.hfcache_layout import cache_repo
from lab.tinymodel import generate_repo
from sparkdeploy.steps.readiness_gate import GateEvent, ReadinessGate, follow_lines

STANDIN = REPO_ROOT / "lab" / "engine" / "vllm_standin.py"
MODEL = "lab/tiny-chat"
SERVED = "tiny"
BOOT_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 5.0
TARGET_S = 1.0
LAST_MARKER = "application_ready"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def one_boot(hf_cache: Path) -> tuple[float, float]:
    """(seconds from the gate's start to the last marker, seconds from it to ready)."""
    port = free_port()
    events: queue.Queue[GateEvent] = queue.Queue()
    gate = ReadinessGate(head="head")
    argv = [sys.executable, str(STANDIN), "serve", MODEL, "--served-model-name", SERVED]
    process = subprocess.Popen(
        [*argv, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "HF_HUB_CACHE": str(hf_cache),
            "HF_HUB_OFFLINE": "1",
            "STANDIN_FAULT": "",
        },
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        follow_lines(events, "head", process.stdout, lambda: None)
        result = gate.wait(
            events,
            endpoint=f"http://127.0.0.1:{port}",
            served_model_name=SERVED,
            timeout_s=BOOT_TIMEOUT_S,
        )
    finally:
        stop_process_group(process, grace_s=STOP_TIMEOUT_S)
    last = next(entry for entry in result.timeline if entry.marker == LAST_MARKER)
    return last.seconds, result.ready_after_s - last.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-readiness-") as scratch:
        root = Path(scratch)
        hf_cache = root / "hf-cache"
        cache_repo(generate_repo(root / "repos", MODEL), hf_cache)
        delays = []
        for round_number in range(1, options.rounds + 1):
            boot_s, delay_s = one_boot(hf_cache)
            delays.append(delay_s)
            print(
                f"round {round_number}: last marker at {boot_s:.3f} s, ready "
                f"{delay_s * 1000:.1f} ms later"
            )
    worst = max(delays)
    print(
        f"readiness noticed after the last marker: median {statistics.median(delays) * 1000:.1f}"
        f" ms, worst {worst * 1000:.1f} ms over {len(delays)} boots; worst / {TARGET_S:g} s "
        f"target = {worst / TARGET_S:.3f} ({'within' if worst <= TARGET_S else 'OVER'} target)"
    )


if __name__ == "__main__":
    main()
