"""An external eval: a tool run against the endpoint, on the ops host or as a container on the
head node, whose score is read from its stdout or from the file it wrote (docs/quality.md, "The
external contract").

The argv is the recipe's with each placeholder item replaced whole ({endpoint}, {model},
{score_file}); no shell ever reads it. The deployment's API key reaches the tool in the
environment variable `api_key_env` names (vLLM's "EMPTY" when the deployment has none), never
in an argv, and is masked in any output quoted. A tool that cannot be started, exits non-zero,
runs past its timeout or prints no score leaves its eval without a score, named so with its
last lines: never a pass.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from sparkdeploy.errors import RemoteError, TransientRemoteError
from sparkdeploy.remote.docker_cli import docker
from sparkdeploy.remote.runner import Runner
from sparkdeploy.report.quality import EvalResult
from sparkdeploy.secrecy import is_secret_name, redact
from sparkdeploy.spec.quality import (
    ENDPOINT,
    MODEL,
    NO_API_KEY,
    SCORE_FILE,
    ExternalEval,
    json_path_steps,
)

# How many of a failed tool's last output lines its error quotes.
LAST_LINES = 12
# The tool's own directory in its container (an anonymous volume, read back by `docker cp`).
CONTAINER_DIR = "/sparkdeploy-eval"
SCORE_NAME = "score"
# Beyond the eval's timeout, for the SSH round trip of `timeout ... docker wait`.
WAIT_MARGIN_S = 30.0
DOCKER_STEP_TIMEOUT_S = 60.0
# Reads the API key from stdin into the variable named by $1, so that `docker run -e NAME`
# passes it on without it ever being in an argv. Fixed text: every value is an argument.
_DOCKER_WITH_KEY = 'n=$1; shift; IFS= read -r v; export "$n=$v"; exec docker "$@"'


class NoScore(Exception):
    """Why an external eval has no score (the tool's last lines included)."""


@dataclass(frozen=True)
class ToolOutput:
    exit_code: int
    stdout: str
    stderr: str
    score_file: str | None  # the text of {score_file} after the run; None: not written


@dataclass(frozen=True)
class EvalTarget:
    """Where the tool runs and what it is handed."""

    endpoint: str
    model: str
    api_key: SecretStr | None
    workdir: Path  # the ops host's working directory (the project's root)
    head_node: str
    head_runner: Callable[[], Runner]  # opened only for an image eval
    container_name: str


def substitute(argv: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """The argv with each item that is a placeholder replaced whole by its value."""
    return [values.get(item, item) for item in argv]


def last_lines(text: str, secrets: Sequence[SecretStr | None]) -> str:
    """The last LAST_LINES non-blank lines of `text`, indented, secrets masked."""
    lines = [line for line in text.splitlines() if line.strip()]
    tail = "\n".join(f"    | {line}" for line in lines[-LAST_LINES:])
    return redact(tail, secrets) if tail else "    (no output)"


def read_score(external: ExternalEval, output: ToolOutput) -> float:
    """The score the tool printed (or wrote), as its parser finds it; NoScore if none."""
    if external.score_from == "file":
        if output.score_file is None:
            raise NoScore(f'it wrote no {SCORE_FILE} (score_from = "file")')
        text, source = output.score_file, SCORE_FILE
    else:
        text, source = output.stdout, "stdout"
    if external.score_regex is not None:
        matches = list(re.finditer(external.score_regex, text, re.MULTILINE))
        if not matches:
            raise NoScore(f"score_regex {external.score_regex!r} matched nothing in its {source}")
        last = matches[-1]
        if "score" in last.re.groupindex:
            value: Any = last.group("score")
        else:
            value = last.group(1) if last.re.groups else last.group(0)
        where = f"score_regex {external.score_regex!r}"
    else:
        path = str(external.score_json)
        value = _json_value(_json_document(text, source), path, source)
        where = f"score_json {path!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise NoScore(f"{where} found {value!r} in its {source}, not a number")
    try:
        return float(value)
    except ValueError:
        raise NoScore(f"{where} found {value!r} in its {source}, not a number") from None


def _json_document(text: str, source: str) -> Any:
    """The JSON of a tool's output: the whole text, else its last line that parses."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    for line in reversed(text.splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    raise NoScore(f"its {source} holds no JSON document")


def _json_value(document: Any, path: str, source: str) -> Any:
    value = document
    for step in json_path_steps(path):
        found = isinstance(value, dict) and step in value
        found = found or (isinstance(value, list) and isinstance(step, int) and step < len(value))
        if not found:
            raise NoScore(f"score_json {path!r}: no {step!r} in the JSON of its {source}")
        value = value[step]
    return value


def run_on_ops_host(
    argv: Sequence[str], env_name: str, api_key: str, timeout_s: float, workdir: Path
) -> ToolOutput:
    """argv run in `workdir` (score file in a fresh temporary directory), with this process's
    environment less its secrets, and the API key in `env_name`."""
    env = {name: value for name, value in os.environ.items() if not is_secret_name(name)}
    env[env_name] = api_key
    with tempfile.TemporaryDirectory(prefix="sparkdeploy-eval-") as scratch:
        score_path = Path(scratch) / SCORE_NAME
        command = substitute(argv, {SCORE_FILE: str(score_path)})
        try:
            process = subprocess.Popen(
                command,
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: a timeout ends all of it
            )
        except FileNotFoundError:
            raise NoScore(
                f"command not found: {command[0]!r} is neither on the ops host's PATH nor a "
                f"file under {workdir}; install the tool or fix command[0]"
            ) from None
        except PermissionError:
            raise NoScore(
                f"{command[0]!r} cannot be run on the ops host (permission denied): make it "
                "executable or run it through its interpreter"
            ) from None
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            raise _timed_out(timeout_s, _decoded(-9, stdout, stderr, None)) from None
        written = score_path.read_text(errors="replace") if score_path.is_file() else None
        return _decoded(process.returncode, stdout, stderr, written)


class _TimedOut(NoScore):
    def __init__(self, message: str, output: ToolOutput) -> None:
        super().__init__(message)
        self.output = output


def _timed_out(timeout_s: float, output: ToolOutput) -> _TimedOut:
    return _TimedOut(f"ran past its timeout of {timeout_s:g} s and was killed", output)


def _decoded(exit_code: int, stdout: bytes, stderr: bytes, written: str | None) -> ToolOutput:
    return ToolOutput(
        exit_code, stdout.decode(errors="replace"), stderr.decode(errors="replace"), written
    )


def run_on_head(
    runner: Runner,
    image: str,
    argv: Sequence[str],
    env_name: str,
    api_key: str,
    timeout_s: float,
    container: str,
) -> ToolOutput:
    """`docker run` of image with argv on the head node (host network, so the endpoint is
    reached as from the ops host); waited for up to timeout_s, then its output and score file
    read and the container removed."""
    command = substitute(argv, {SCORE_FILE: f"{CONTAINER_DIR}/{SCORE_NAME}"})
    started = time.monotonic()
    try:
        docker(runner, ["rm", "-f", "-v", container], timeout=DOCKER_STEP_TIMEOUT_S)  # a stale one
        run = runner.run(
            [
                *("sh", "-c", _DOCKER_WITH_KEY, "sh", env_name, "run", "--detach"),
                *("--name", container, "--network", "host", "--env", env_name),
                *("--volume", CONTAINER_DIR, image, *command),
            ],
            timeout=timeout_s,
            stdin=f"{api_key}\n".encode(),
            check=False,
        )
        if run.exit_code != 0:
            stderr = run.stderr.decode(errors="replace")
            raise NoScore(
                f"`docker run` of {image} exited {run.exit_code} (image not found, or its "
                f"command not found?):\n{last_lines(stderr, [])}"
            )
        remaining = max(1.0, timeout_s - (time.monotonic() - started))
        waited = runner.run(
            ["timeout", f"{remaining:.0f}", "docker", "wait", container],
            timeout=remaining + WAIT_MARGIN_S,
            check=False,
        )
        logs = docker(runner, ["logs", container], timeout=DOCKER_STEP_TIMEOUT_S)
        timed_out = waited.exit_code == 124
        status = waited.stdout.decode().strip()
        exit_code = -9 if timed_out else int(status) if status.isdigit() else -1
        output = ToolOutput(
            exit_code,
            logs.stdout.decode(errors="replace"),
            logs.stderr.decode(errors="replace"),
            None if timed_out else _copied_score(runner, container),
        )
        if timed_out:
            raise _timed_out(timeout_s, output)
        return output
    except TransientRemoteError:
        raise
    except RemoteError as error:
        raise NoScore(f"on the head node: {error}") from None
    finally:
        docker(runner, ["rm", "-f", "-v", container], timeout=DOCKER_STEP_TIMEOUT_S)


def _copied_score(runner: Runner, container: str) -> str | None:
    """The container's score file, read as `docker cp` sends it (a tar stream); None if absent."""
    copied = docker(
        runner,
        ["cp", f"{container}:{CONTAINER_DIR}/{SCORE_NAME}", "-"],
        timeout=DOCKER_STEP_TIMEOUT_S,
    )
    if copied.exit_code != 0:
        return None
    try:
        with tarfile.open(fileobj=io.BytesIO(copied.stdout)) as archive:
            member = next((entry for entry in archive.getmembers() if entry.isfile()), None)
            extracted = archive.extractfile(member) if member is not None else None
            return None if extracted is None else extracted.read().decode(errors="replace")
    except tarfile.TarError:
        return None


def run_external(external: ExternalEval, target: EvalTarget) -> EvalResult:
    """The eval run where its recipe says, its score read and judged."""
    started = time.monotonic()
    bound, threshold = external.threshold
    argv = substitute(external.command, {ENDPOINT: target.endpoint, MODEL: target.model})
    api_key = target.api_key.get_secret_value() if target.api_key is not None else NO_API_KEY
    where = f"image {external.image} on {target.head_node}" if external.image else "the ops host"
    shown = f"`{shlex.join(argv)}` ({where})"

    def result(score: float | None, evidence: str, error: str | None = None) -> EvalResult:
        return EvalResult(
            external.name,
            score,
            threshold,
            bound,
            None,
            time.monotonic() - started,
            evidence=evidence,
            error=error,
        )

    output: ToolOutput | None = None
    try:
        if external.image is not None:
            output = run_on_head(
                target.head_runner(),
                external.image,
                argv,
                external.api_key_env,
                api_key,
                external.timeout_s,
                target.container_name,
            )
        else:
            output = run_on_ops_host(
                argv, external.api_key_env, api_key, external.timeout_s, target.workdir
            )
        if output.exit_code != 0:
            raise NoScore(f"it exited {output.exit_code}")
        return result(read_score(external, output), f"{shown}: exit 0")
    except NoScore as failure:
        secrets = [target.api_key]
        if isinstance(failure, _TimedOut):
            output = failure.output
        tail = "" if output is None else last_lines(output.stdout + "\n" + output.stderr, secrets)
        lines = f"; its last lines:\n{tail}" if tail else ""
        return result(None, shown, f"{shown}: {failure}{lines}")
