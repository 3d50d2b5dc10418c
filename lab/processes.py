"""Processes on the host: the commands the lab runs to completion (`run`), the daemons it starts
in a session of their own (`spawn_daemon`), the children it starts with their output in a log
(`start_logged`) and waits for (`wait_until_ready`), and stopping
processes, by PID with SIGTERM then SIGKILL (`terminate`, `kill_at_once`), or, for the children
the lab, the tests and bench/ start with `start_new_session=True`, by process group
(`stop_process_group`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from lab.layout import REPO_ROOT
from sparkdeploy.errors import LabError

COMMAND_TIMEOUT_S = 15
STOP_TIMEOUT_S = 4

# The daemons spawn_daemon started: our children, which alive() reaps once they exit, so none
# lingers as a zombie.
_spawned: dict[int, subprocess.Popen[bytes]] = {}


def run(argv: list[str], *, stdin: bytes | None = None, timeout: float = COMMAND_TIMEOUT_S) -> str:
    """Run a host command (argv, never a shell); LabError with its stderr when it fails."""
    try:
        completed = subprocess.run(
            argv, input=stdin, capture_output=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as error:
        raise LabError(f"`{' '.join(argv)}` did not finish within {timeout} s") from error
    if completed.returncode != 0:
        raise LabError(
            f"`{' '.join(argv)}` exited {completed.returncode}:"
            f" {completed.stderr.decode(errors='replace').strip()[-800:]}"
        )
    return completed.stdout.decode()


def spawn_daemon(argv: list[str], log_path: Path) -> int:
    """Start a lab daemon in its own session, so it outlives the `lab up` command; its PID."""
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            env={"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")},
            # The hub is `python -m lab.hub`: the lab imports from the checkout's root.
            cwd=REPO_ROOT,
        )
    _spawned[process.pid] = process
    return process.pid


def start_logged(
    argv: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """A child in a session of its own (stop it with stop_process_group), without stdin, its
    output appended to log_path."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(argv),
            env=None if env is None else dict(env),
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def wait_until_ready(
    process: subprocess.Popen[bytes],
    ready: Callable[[], bool],
    *,
    name: str,
    log_path: Path,
    timeout_s: float,
    poll_s: float,
    stop: Callable[[], None],
) -> None:
    """Return once `ready()`, asked every poll_s; LabError naming `name` and its log when the
    process exits first, or when timeout_s has passed (after `stop()`)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if process.poll() is not None:
            raise LabError(
                f"{name} exited with code {process.returncode} before it was ready; its log is"
                f" {log_path}"
            )
        if time.monotonic() > deadline:
            stop()
            raise LabError(f"{name} not ready after {timeout_s:.0f} s; its log is {log_path}")
        time.sleep(poll_s)


def alive(pid: int) -> bool:
    """Whether any thread of the process still runs. A zombie leader is not enough: in an
    exit_group the leader can turn Z while its other threads are still exiting and holding the
    node's mounts and namespaces. A zombie that is not our child (re-parented to init, which
    reaps when it likes) is gone; ours are reaped here."""
    process = _spawned.get(pid)
    if process is not None:
        # waitpid returns only once every thread of the process has exited.
        return process.poll() is None
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return False
    for task in tasks:
        try:
            stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
            return True
    return False


def command_name(pid: int) -> str | None:
    """The process's command name (/proc/PID/comm); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return None


def describe(pids: Iterable[int]) -> str:
    """PIDs with their command lines, for an error that says what would not stop."""
    described = []
    for pid in sorted(pids):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            command = " ".join(part.decode(errors="replace") for part in argv if part)
        except (FileNotFoundError, ProcessLookupError):
            command = "(gone)"
        described.append(f"{pid} ({command[:120] or 'kernel thread or zombie'})")
    return ", ".join(described)


def signal_all(pids: Iterable[int], signum: int) -> None:
    """`signum` to each process; one that has exited already is skipped."""
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            continue


def terminate(pids: set[int]) -> None:
    """SIGTERM, then SIGKILL what is left after STOP_TIMEOUT_S; returns once every thread of
    every one has exited (LabError naming them if any outlives the SIGKILL by STOP_TIMEOUT_S)."""
    signal_all(pids, signal.SIGTERM)
    for signum in (signal.SIGKILL, None):
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while pids and time.monotonic() < deadline:
            pids = {pid for pid in pids if alive(pid)}
            if pids:
                time.sleep(0.02)
        if not pids:
            break
        if signum is None:
            raise LabError(
                f"lab processes still running {STOP_TIMEOUT_S} s after SIGKILL: {describe(pids)};"
                " look for a process stuck in the kernel (state D in /proc/PID/stat), e.g. on an"
                " unreachable mount, and remove its cause before `python -m lab down` again"
            )
        signal_all(pids, signum)
    for pid in list(_spawned):
        if _spawned[pid].poll() is not None:
            del _spawned[pid]


def kill_at_once(pids: set[int], owner: str) -> None:
    """SIGKILL to every one at once, as when their machine loses power; returns once all have
    exited (LabError naming `owner` and them if any is alive STOP_TIMEOUT_S later)."""
    signal_all(pids, signal.SIGKILL)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise LabError(f"{owner}: still alive after SIGKILL: {describe(pids)}")
        time.sleep(0.05)


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
