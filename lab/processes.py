"""Stopping the child processes the lab, the tests and bench/ start in a session of their own
(`start_new_session=True`), by their process group."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_process_group(
    process: subprocess.Popen[bytes],
    *,
    first_signal: signal.Signals = signal.SIGTERM,
    grace_s: float = 15.0,
) -> None:
    """`first_signal` to the process group led by `process` (its forks go too: the Prefect
    server's uvicorn, a worker's flow runs), then SIGKILL if it has not exited within grace_s;
    nothing if it has exited already."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, first_signal)
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=grace_s)
    except ProcessLookupError:
        pass
