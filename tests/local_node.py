"""Run node scripts on this machine as sparkdeploy.ssh runs them on a node, minus SSH.

The script goes to a fresh `python3 -I -S` (isolated, no site-packages): only the standard
library is importable, as on a DGX node where nothing of ours is installed.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from sparkdeploy.ssh import CommandResult


class LocalPython:
    def run_python(
        self,
        source: str,
        args: Sequence[str],
        *,
        timeout: float,
        stdin: bytes | None = None,
        check: bool = True,
    ) -> CommandResult:
        argv = ("python3", "-I", "-S", "-", *args)
        completed = subprocess.run(
            argv, input=source.encode() + (stdin or b""), capture_output=True, timeout=timeout
        )
        assert not check or completed.returncode == 0, completed.stderr.decode()
        return CommandResult(argv, completed.returncode, completed.stdout, completed.stderr)
