"""One engine stand-in (lab/engine/vllm_standin.py) as a local process on loopback, serving a
lab.tinymodel repo from a temporary HF cache; for the benchmark's tests and bench/. Stopped by
its PID when the `with` block ends."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from lab.layout import REPO_ROOT
from lab.processes import start_logged, stop_process_group
from lab.testing.hfcache_layout import cache_repo
from lab.tinymodel import generate_repo
from sparkdeploy.remote.engine_http import probe_endpoint

STANDIN = REPO_ROOT / "lab" / "engine" / "vllm_standin.py"
MODEL = "lab/tiny-chat"
SERVED = "tiny"
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def local_standin(*flags: str, env: Mapping[str, str] | None = None) -> Iterator[str]:
    """The endpoint (http://127.0.0.1:PORT) of a ready stand-in serving `SERVED`."""
    with tempfile.TemporaryDirectory(prefix="standin-") as workdir:
        root = Path(workdir)
        cache_repo(generate_repo(root / "repos", MODEL), root / "hf-cache")
        port = _free_port()
        process = start_logged(
            [
                *(sys.executable, str(STANDIN), "serve", MODEL, "--served-model-name", SERVED),
                *("--host", "127.0.0.1", "--port", str(port), *flags),
            ],
            root / "engine.log",
            env={
                **os.environ,
                "PYTHONPATH": str(REPO_ROOT),
                "HF_HUB_CACHE": str(root / "hf-cache"),
                "HF_HUB_OFFLINE": "1",
                "STANDIN_FAULT": "",
                **(env or {}),
            },
        )
        try:
            endpoint = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not probe_endpoint(endpoint, SERVED, timeout=1.0).ready:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the stand-in did not get ready: {(root / 'engine.log').read_text()}"
                    )
                time.sleep(0.05)
            yield endpoint
        finally:
            stop_process_group(process, grace_s=STOP_TIMEOUT_S)
