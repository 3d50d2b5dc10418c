"""The lab's tiny chat model for real vLLM, on the host side: trained on lab.chat_lessons once
per fingerprint by lab.chat_trainer under the vLLM runtime's Python (which has torch,
transformers and tokenizers, not the project's dependencies), cached, and published to the lab
hub. The host needs no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from lab import chat_trainer
from lab.chat_lessons import answer_problem, lessons
from lab.chat_trainer import MODEL_FILES, lessons_json
from lab.tinymodel import GeneratedRepo, repo_staging
from sparkdeploy.errors import LabError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CHAT_MODEL_REPO = "lab/tiny-llama-chat"
TRAINER_SOURCE = Path(chat_trainer.__file__)

MARKER = "chat-model.done"  # written last into a complete cache entry
LESSONS_FILE = "lessons.json"  # what the trainer was taught, kept in its cache entry
TRAIN_TIMEOUT_S = 900.0


def chat_model_fingerprint(
    runtime_version: str, taught: str, trainer: Path = TRAINER_SOURCE
) -> str:
    """Names a trained model: its trainer, its lessons (as JSON) and the runtime's versions. A
    change to a check or a detector, or to any prompt the model is not taught, keeps it."""
    digest = hashlib.sha256()
    for part in (trainer.read_bytes(), taught.encode(), runtime_version.encode()):
        digest.update(part + b"\0")
    return digest.hexdigest()[:16]


_VERSIONS_SCRIPT = (
    "import importlib.metadata as m, sys\n"
    "print(sys.version.split()[0], *(n + '==' + m.version(n) for n in "
    "('torch', 'transformers', 'tokenizers', 'safetensors')))\n"
)


def runtime_versions(runtime_python: Path) -> str:
    """The runtime's Python, torch, transformers, tokenizers and safetensors versions."""
    result = _run([str(runtime_python), "-c", _VERSIONS_SCRIPT], timeout_s=60.0)
    if result.returncode != 0:
        raise LabError(
            f"{runtime_python} cannot tell its torch/transformers versions (exit "
            f"{result.returncode}):\n{_tail(result.stderr)}\n"
            "fix: point at the vLLM runtime's Python, which has torch and transformers"
        )
    return result.stdout.strip()


def ensure_chat_model(
    runtime_python: Path,
    cache_dir: Path,
    *,
    runtime_version: str | None = None,
    timeout_s: float = TRAIN_TIMEOUT_S,
) -> Path:
    """The trained chat model's directory under cache_dir, training it first if needed.

    The cache entry is cache_dir/<fingerprint>/, complete once it holds MARKER. Training runs
    `runtime_python -m lab.chat_trainer` (the host needs no torch) on the lessons, written to
    LESSONS_FILE, into a staging directory that is renamed into place. runtime_version defaults
    to the versions the runtime reports.
    """
    todo = lessons()
    for lesson in todo:
        problem = answer_problem(lesson, lesson.answer)
        if problem:
            raise LabError(f"the lab chat model's lesson {lesson.name} fails its check: {problem}")
    taught = lessons_json(todo)
    version = runtime_version if runtime_version is not None else runtime_versions(runtime_python)
    fingerprint = chat_model_fingerprint(version, taught)
    final = cache_dir / fingerprint
    if (final / MARKER).is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = cache_dir / f".{fingerprint}.training-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        (staging / LESSONS_FILE).write_text(taught)
        command = [
            str(runtime_python),
            "-m",
            "lab.chat_trainer",
            str(staging / LESSONS_FILE),
            str(staging),
        ]
        try:
            result = _run(command, timeout_s=timeout_s)
        except subprocess.TimeoutExpired as error:
            raise LabError(
                f"training the lab chat model with {runtime_python} took over {timeout_s:g} s:\n"
                f"{_tail(_text(error.stderr))}\nfix: is the machine busy? it takes ~1 min"
            ) from None
        missing = [name for name in MODEL_FILES if not (staging / name).is_file()]
        if result.returncode != 0 or missing:
            why = f"exit {result.returncode}" if result.returncode else f"no {', '.join(missing)}"
            raise LabError(
                f"training the lab chat model with {runtime_python} failed ({why}):\n"
                f"{_tail(result.stderr or result.stdout)}\n"
                "fix: the runtime's Python needs torch, transformers and tokenizers; the "
                "message above names the lesson the model could not learn, if any"
            )
        marker = {"fingerprint": fingerprint, "runtime": version, "summary": result.stdout.strip()}
        (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if (final / MARKER).is_file():  # another process finished first: keep its copy
            return final
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def publish_chat_model(
    repos_dir: str | os.PathLike[str], model_dir: Path, repo_id: str = CHAT_MODEL_REPO
) -> GeneratedRepo:
    """Copy a trained model into repos_dir/<org>/<name>/ for the lab hub and index it."""
    missing = [file for file in MODEL_FILES if not (model_dir / file).is_file()]
    if missing:
        raise LabError(f"{model_dir} is no complete chat model: no {', '.join(missing)}")
    final, staging = repo_staging(repos_dir, repo_id)
    for file in MODEL_FILES:
        shutil.copyfile(model_dir / file, staging / file)
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    final.with_name(f"{final.name}.gated").unlink(missing_ok=True)
    from lab.hub.index import index_repo

    index_repo(repos_dir, repo_id)
    config = json.loads((final / "config.json").read_text())
    return GeneratedRepo(final, repo_id, MODEL_FILES, ("model.safetensors",), config=config)


def _run(command: Sequence[str], *, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        part for part in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if part
    )
    return subprocess.run(
        list(command),
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def _text(data: str | bytes | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def _tail(text: str, lines: int = 20) -> str:
    kept = text.strip().splitlines()[-lines:]
    return "\n".join(f"  | {line}" for line in kept) if kept else "  (no output)"
