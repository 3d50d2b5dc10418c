"""External evals: a command on the ops host (run here) and an image on the head node (a scripted
node answering as docker would). A score is read from stdout or the score file; a tool that
cannot start, exits non-zero, runs past its timeout or prints no score is a named failure with
its last lines, never a pass; the API key is in the environment only, and masked."""

from __future__ import annotations

import io
import json
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from lab.testing.local_node import ScriptedNode
from sparkdeploy.report.quality import EvalResult
from sparkdeploy.spec.quality import ExternalEval
from sparkdeploy.steps.quality.external import CONTAINER_DIR, EvalTarget, run_external

KEY = "sk-quality-test-key"


def target(tmp_path: Path, node: ScriptedNode | None = None, key: str | None = KEY) -> EvalTarget:
    return EvalTarget(
        endpoint="http://10.77.0.11:8000",
        model="tiny",
        api_key=SecretStr(key) if key is not None else None,
        workdir=tmp_path,
        head_node="node1",
        head_runner=lambda: node or ScriptedNode(),
        container_name="sparkdeploy-eval-x-0",
    )


def python(source: str) -> list[str]:
    return [sys.executable, "-c", source]


def evaluation(command: list[str], **fields: Any) -> ExternalEval:
    return ExternalEval(
        **{"name": "bench", "command": command, "score_json": "score", "min_score": 80, **fields}
    )


def run(tmp_path: Path, external: ExternalEval, **target_fields: Any) -> EvalResult:
    return run_external(external, target(tmp_path, **target_fields))


def script(tmp_path: Path, source: str) -> list[str]:
    """A tool: `source` as a Python script of its own."""
    path = tmp_path / "tool.py"
    path.write_text(source)
    return [sys.executable, str(path)]


def test_a_commands_score_is_read_and_judged(tmp_path: Path) -> None:
    tool = script(
        tmp_path,
        "import json, os\nprint('warming up')\n"
        f"print(json.dumps({{'score': 91.5 if os.environ['TOOL_KEY'] == {KEY!r} else 0}}))",
    )
    result = run(
        tmp_path,
        evaluation([*tool, "--url", "{endpoint}", "{model}"], api_key_env="TOOL_KEY"),
    )
    assert result.passed, result
    assert result.score == 91.5, result
    assert result.bound == "min", result
    assert result.samples is None
    assert result.error is None
    assert result.evidence == (
        f"`{' '.join(tool)} --url http://10.77.0.11:8000 tiny` (the ops host): exit 0"
    )


def test_the_tool_gets_the_placeholders_the_key_and_no_other_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf-not-for-tools")
    seen = tmp_path / "seen.json"
    tool = (
        "import json, os, sys; json.dump({'argv': sys.argv[1:], 'key': os.environ.get("
        "'OPENAI_API_KEY'), 'hf': os.environ.get('HF_TOKEN'), 'cwd': os.getcwd()}, "
        f"open({str(seen)!r}, 'w')); print(json.dumps({{'score': 1}}))"
    )
    run(tmp_path, evaluation([*python(tool), "{endpoint}", "{model}"]), key=None)
    saw = json.loads(seen.read_text())
    assert saw["argv"] == ["http://10.77.0.11:8000", "tiny"]
    assert saw["key"] == "EMPTY"  # vLLM's convention when the server asks for no key
    assert saw["hf"] is None
    assert saw["cwd"] == str(tmp_path)


@pytest.mark.parametrize(
    ("output", "parser", "score"),
    [
        (
            "step 1\nfinal score: 72\nsummary\nfinal score: 88.5\n",
            {"score_regex": r"score: ([\d.]+)"},
            88.5,
        ),
        ("total=3 passed=95\n", {"score_regex": r"passed=(?P<score>\d+)"}, 95.0),
        ("97\n", {"score_regex": r"^\d+$"}, 97.0),
        ('{"scores": {"final_score": 89}}', {"score_json": "scores.final_score"}, 89.0),
        ('log line\n{"results": [{"score": "0.5"}]}\n', {"score_json": "results[0].score"}, 0.5),
    ],
)
def test_score_parsers(tmp_path: Path, output: str, parser: dict[str, str], score: float) -> None:
    command = python(f"print({output!r}, end='')")
    fields: dict[str, Any] = {"name": "b", "command": command, "max_score": 100, **parser}
    result = run(tmp_path, ExternalEval(**fields))
    assert result.score == score, result


def test_the_score_file(tmp_path: Path) -> None:
    tool = "import sys; open(sys.argv[2], 'w').write('{\"final_score\": 86}')"
    external = evaluation(
        [*python(tool), "--json-file", "{score_file}"], score_from="file", score_json="final_score"
    )
    result = run(tmp_path, external)
    assert result.passed
    assert result.score == 86.0
    assert result.verdict() == "bench 86: within ≥ 80"


@pytest.mark.parametrize(
    ("command", "fields", "error"),
    [
        (["no-such-eval-tool", "{endpoint}"], {}, "command not found: 'no-such-eval-tool'"),
        (python("print('hello'); print('scored nothing')"), {}, "holds no JSON document"),
        (python("print('{\"other\": 1}')"), {}, "no 'score' in the JSON of its stdout"),
        (python("print('{\"score\": null}')"), {}, "found None in its stdout, not a number"),
        (
            python("print('score: n/a')"),
            {"score_json": None, "score_regex": r"score: (\S+)"},
            "found 'n/a' in its stdout, not a number",
        ),
        (
            python("print('nothing')"),
            {"score_json": None, "score_regex": r"score=(\d+)"},
            "score_regex 'score=(\\\\d+)' matched nothing in its stdout",
        ),
        (python("import sys; print('{\"score\": 99}'); sys.exit(3)"), {}, "it exited 3"),
        (
            [*python("print('{\"score\": 99}')"), "{score_file}"],
            {"score_from": "file"},
            'it wrote no {score_file} (score_from = "file")',
        ),
    ],
)
def test_a_tool_without_a_score_is_a_named_failure(
    tmp_path: Path, command: list[str], fields: dict[str, Any], error: str
) -> None:
    result = run(tmp_path, evaluation(command, **fields))
    assert not result.passed, result
    assert result.score is None, result
    assert result.error is not None, result.error
    assert error in result.error, result.error
    assert result.verdict().startswith("bench: no score: `")


def test_a_failure_quotes_the_last_lines_without_the_key(tmp_path: Path) -> None:
    tool = (
        "import os, sys; [print(f'line {i}') for i in range(30)]; "
        "print('auth failed for', os.environ['OPENAI_API_KEY'], file=sys.stderr); sys.exit(2)"
    )
    result = run(tmp_path, evaluation(python(tool)))
    assert result.error is not None
    lines = result.error.split("its last lines:\n")[1].splitlines()
    assert lines[0] == "    | line 19"
    assert len(lines) == 12
    assert lines[-1] == "    | auth failed for ***"
    assert KEY not in result.error


def test_a_tool_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    child = tmp_path / "child-alive"
    grandchild = f"import time; time.sleep(2); open({str(child)!r}, 'w')"
    tool = script(
        tmp_path,
        "import subprocess, sys, time\nprint('started', flush=True)\n"
        f"subprocess.Popen([sys.executable, '-c', {grandchild!r}])\ntime.sleep(60)\n",
    )
    started = time.monotonic()
    result = run(tmp_path, evaluation(tool, timeout_s=1))
    assert time.monotonic() - started < 10
    assert result.error is not None
    assert "ran past its timeout of 1 s and was killed; its last lines:\n    | started" in (
        result.error
    )
    time.sleep(2.5)
    assert not child.exists(), "the tool's child outlived the timeout"


def _tar(name: str, data: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


IMAGE_EVAL = ExternalEval(
    name="lab-answers",
    image="lab/vllm-standin:latest",
    command=[
        "python3",
        "/opt/standin/answer_eval.py",
        "--base-url",
        "{endpoint}",
        "--json-file",
        "{score_file}",
    ],
    score_from="file",
    score_json="score",
    min_score=100,
)


def test_an_image_runs_on_the_head_with_the_key_on_stdin(tmp_path: Path) -> None:
    node = ScriptedNode(
        (1, b"", b"Error: No such container"),  # rm of a stale one
        (0, b"c0ffee\n", b""),  # run --detach
        (0, b"0\n", b""),  # wait: the container's exit code
        (0, b'{"score": 100.0}\n', b"question 1: expected 372\n"),  # logs
        (0, _tar("score", b'{"score": 100.0, "samples": 8}'), b""),  # cp
        (0, b"", b""),  # rm
    )
    result = run(tmp_path, IMAGE_EVAL, node=node)
    assert result.passed, result
    assert result.score == 100.0, result
    assert "(image lab/vllm-standin:latest on node1): exit 0" in result.evidence
    rm, start, wait, logs, copy, remove = node.ran
    assert rm.argv == ("docker", "rm", "-f", "-v", "sparkdeploy-eval-x-0") == remove.argv
    assert start.argv[:5] == ("sh", "-c", start.argv[2], "sh", "OPENAI_API_KEY")
    assert start.argv[5:] == (
        *("run", "--detach", "--name", "sparkdeploy-eval-x-0", "--network", "host"),
        *("--env", "OPENAI_API_KEY", "--volume", CONTAINER_DIR, "lab/vllm-standin:latest"),
        *("python3", "/opt/standin/answer_eval.py", "--base-url", "http://10.77.0.11:8000"),
        *("--json-file", f"{CONTAINER_DIR}/score"),
    )
    assert start.stdin == f"{KEY}\n".encode()
    assert all(KEY not in " ".join(ran.argv) for ran in node.ran)
    assert wait.argv[0] == "timeout"
    assert wait.argv[2:] == ("docker", "wait", "sparkdeploy-eval-x-0")
    assert logs.argv == ("docker", "logs", "sparkdeploy-eval-x-0")
    assert copy.argv == ("docker", "cp", f"sparkdeploy-eval-x-0:{CONTAINER_DIR}/score", "-")


def test_an_image_that_cannot_be_run_is_named(tmp_path: Path) -> None:
    node = ScriptedNode(
        (0, b"", b""),
        (125, b"", b"Unable to find image 'lab/nope:1' locally\npull access denied for lab/nope"),
        (0, b"", b""),
    )
    result = run(tmp_path, IMAGE_EVAL.model_copy(update={"image": "lab/nope:1"}), node=node)
    assert result.error is not None
    assert "`docker run` of lab/nope:1 exited 125" in result.error
    assert "    | pull access denied for lab/nope" in result.error
    assert node.ran[-1].argv[:3] == ("docker", "rm", "-f")


def test_an_image_past_its_timeout_is_removed(tmp_path: Path) -> None:
    node = ScriptedNode(
        (0, b"", b""),
        (0, b"c0ffee\n", b""),
        (124, b"", b""),  # `timeout` ended `docker wait`
        (0, b"still thinking\n", b""),
        (0, b"", b""),
    )
    result = run(tmp_path, IMAGE_EVAL.model_copy(update={"timeout_s": 5.0}), node=node)
    assert result.error is not None
    assert "ran past its timeout of 5 s and was killed; its last lines:\n    | still thinking" in (
        result.error
    )
    assert node.ran[-1].argv == ("docker", "rm", "-f", "-v", "sparkdeploy-eval-x-0")
