"""vLLM-shaped log lines and the fatal error that ends a boot.

vLLM prefixes each line of a child process with `(ProcessName pid=N)`, then the level, the date
and `[file.py:line]`; the readiness gate matches the message part, but operators read the rest.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

VLLM_VERSION = "0.34.0"


class EngineFatal(Exception):
    """Ends the boot: `lines` are printed (the last one is the error vLLM would print), exit 1."""

    def __init__(self, lines: Sequence[str], *, engine_core: bool = True) -> None:
        super().__init__(lines[-1] if lines else "engine failure")
        self.lines = list(lines)
        # Failures inside the engine core process are followed, on the API server, by vLLM's
        # "Engine core initialization failed. See root cause above." line.
        self.engine_core = engine_core


# The emulated processes are threads of one process: print() writes a line and its newline in
# two calls, so another thread's line could land between them (one line with two prefixes).
_WRITE_LOCK = threading.Lock()


def _write_line(stream: TextIO, line: str) -> None:
    with _WRITE_LOCK:
        stream.write(line + "\n")
        stream.flush()


class Logger:
    """Prints vLLM-style lines for one emulated process (APIServer, EngineCore_DP0, Worker_TP1)."""

    def __init__(self, process: str) -> None:
        self.process = process

    def _emit(self, level: str, source: str, message: str, stream: TextIO) -> None:
        stamp = time.strftime("%m-%d %H:%M:%S")
        prefix = f"({self.process} pid={os.getpid()}) " if self.process else ""
        for line in message.splitlines() or [""]:
            _write_line(stream, f"{prefix}{level} {stamp} [{source}] {line}")

    def info(self, source: str, message: str) -> None:
        self._emit("INFO", source, message, sys.stdout)

    def error(self, source: str, message: str) -> None:
        self._emit("ERROR", source, message, sys.stdout)

    def raw(self, line: str) -> None:
        """A line printed without the logging prefix (tracebacks, uvicorn's own lines)."""
        prefix = f"({self.process} pid={os.getpid()}) " if self.process else ""
        _write_line(sys.stdout, f"{prefix}{line}")
