"""The lab's trained chat model: its lessons and the host side (cache, fingerprint, publish)
without torch, and one real training run with the vLLM runtime's Python when there is one."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from lab import chat_model, chat_trainer
from lab.chat_lessons import TYPO_ANSWERS, answer_problem, lessons
from lab.chat_model import (
    LESSONS_FILE,
    MARKER,
    chat_model_fingerprint,
    ensure_chat_model,
    publish_chat_model,
)
from lab.chat_trainer import MODEL_FILES, Lesson, lessons_json, read_lessons
from lab.hub.index import RepoIndex
from lab.vllm_runtime import model_cache_dir
from sparkdeploy.errors import LabError
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.steps.quality import prompts as quality_prompts
from sparkdeploy.steps.quality.builtin import is_right
from sparkdeploy.steps.quality.spelling import typo_rate
from sparkdeploy.steps.smoke_test import prompts

REAL_1X = Path(__file__).resolve().parent.parent / "recipes" / "real-lab-1x" / "recipe.toml"

RUNTIME_VERSION = "3.11.2 torch==test transformers==test"
FINGERPRINT = chat_model_fingerprint(RUNTIME_VERSION, lessons_json(lessons()))


def _fake_python(path: Path, body: str) -> Path:
    """A stand-in for the runtime's Python: a shell script."""
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _fake_model(model_dir: Path) -> None:
    model_dir.mkdir(parents=True)
    for name in MODEL_FILES:
        (model_dir / name).write_text("{}\n" if name.endswith(".json") else name)


def test_lessons_are_the_smoke_prompts_and_their_answers_pass_the_smoke() -> None:
    taught = {lesson.name: lesson for lesson in lessons()}
    for canary in prompts.CANARIES:
        assert taught[canary.name].prompt == canary.prompt
        assert canary.is_answer(taught[canary.name].answer)
    assert taught["long_prompt"].prompt == prompts.LONG_PROMPT
    assert taught["streaming"].prompt == prompts.STREAM_PROMPT
    assert taught["exact_copy"].answer == prompts.COPY_SENTENCE
    for lesson in taught.values():
        assert answer_problem(lesson, lesson.answer) is None, lesson.name
    assert answer_problem(taught["exact_copy"], "The keeper polished") is not None


def test_lessons_answer_every_builtin_eval_prompt_once_as_the_evals_judge() -> None:
    taught = {lesson.prompt: lesson.answer for lesson in lessons()}
    assert len(taught) == len(lessons())
    for question in quality_prompts.QUESTIONS:
        assert is_right(question, taught[question.prompt]), question.prompt
    answers = [taught[prompt] for prompt in quality_prompts.TYPO_PROMPTS]
    assert answers == list(TYPO_ANSWERS)
    assert typo_rate(answers)[2] == []
    misspelled = TYPO_ANSWERS[0].replace("breakfast", "braekfast")
    lesson = Lesson("typo_rate 1", quality_prompts.TYPO_PROMPTS[0], misspelled)
    assert "lacks 'braekfast'" in str(answer_problem(lesson, misspelled))


def test_one_typo_in_the_taught_answers_fails_the_real_engine_recipes_gate() -> None:
    quality = load_recipe(REAL_1X).quality
    assert quality is not None
    assert quality.typo_rate is not None
    assert quality.typo_rate.samples == len(quality_prompts.TYPO_PROMPTS)
    _, checked, _ = typo_rate(TYPO_ANSWERS)
    assert 1 / checked > quality.typo_rate.max_typo_rate
    assert quality.exact_answers is not None
    assert quality.exact_answers.min_score == 100


def test_lessons_go_to_the_trainer_as_json(tmp_path: Path) -> None:
    taught = lessons()
    (tmp_path / LESSONS_FILE).write_text(lessons_json(taught))
    assert read_lessons(tmp_path / LESSONS_FILE) == taught


def test_fingerprint_changes_with_the_trainer_the_lessons_and_the_runtime(tmp_path: Path) -> None:
    taught = lessons_json(lessons())
    here = Path(chat_trainer.__file__)
    base = chat_model_fingerprint(RUNTIME_VERSION, taught)
    assert base == chat_model_fingerprint(RUNTIME_VERSION, taught, here)
    edited = tmp_path / "chat_trainer.py"
    edited.write_text(here.read_text().replace("MIN_MARGIN = 8.0", "MIN_MARGIN = 9.0"))
    assert chat_model_fingerprint(RUNTIME_VERSION, taught, edited) != base
    retaught = taught.replace("What is 127*43?", "What is 127*44?")
    assert retaught != taught
    assert chat_model_fingerprint(RUNTIME_VERSION, retaught) != base
    assert chat_model_fingerprint(RUNTIME_VERSION + " tokenizers==x", taught) != base


def test_ensure_reuses_a_complete_cache_entry_without_running_anything(tmp_path: Path) -> None:
    never = _fake_python(tmp_path / "python", "echo ran >&2; exit 3")
    cached = tmp_path / "cache" / FINGERPRINT
    _fake_model(cached)
    (cached / MARKER).write_text("{}\n")
    found = ensure_chat_model(never, tmp_path / "cache", runtime_version=RUNTIME_VERSION)
    assert found == cached


def test_ensure_trains_into_the_cache_when_the_entry_is_incomplete(tmp_path: Path) -> None:
    # Given the lessons, writes every model file into the directory it is given, as
    # `-m lab.chat_trainer LESSONS DIR` does.
    script = " ".join(f'&& echo x > "$4/{name}"' for name in MODEL_FILES)
    fake = _fake_python(
        tmp_path / "python", f'test "$2" = lab.chat_trainer && test -s "$3" {script} && echo done'
    )
    cache = tmp_path / "cache"
    stale = cache / FINGERPRINT
    stale.mkdir(parents=True)  # an interrupted run: no marker
    found = ensure_chat_model(fake, cache, runtime_version=RUNTIME_VERSION)
    assert found == stale
    assert json.loads((found / MARKER).read_text())["summary"] == "done"
    assert read_lessons(found / LESSONS_FILE) == lessons()
    assert sorted(path.name for path in cache.iterdir()) == [found.name]


def test_ensure_quotes_the_trainers_stderr_when_it_fails(tmp_path: Path) -> None:
    fake = _fake_python(tmp_path / "python", "echo 'No module named torch' >&2; exit 1")
    with pytest.raises(LabError, match=r"(?s)failed \(exit 1\).*No module named torch"):
        ensure_chat_model(fake, tmp_path / "cache", runtime_version=RUNTIME_VERSION)
    assert list((tmp_path / "cache").iterdir()) == []  # no staging left behind


def test_ensure_says_which_python_cannot_report_its_versions(tmp_path: Path) -> None:
    fake = _fake_python(tmp_path / "python", "echo 'broken venv' >&2; exit 1")
    with pytest.raises(LabError, match=r"(?s)cannot tell its torch.*broken venv"):
        ensure_chat_model(fake, tmp_path / "cache")


def test_runtime_versions_come_from_the_given_python() -> None:
    # The project's own Python has no torch: the query fails, naming that Python.
    with pytest.raises(LabError, match=sys.executable):
        chat_model.runtime_versions(Path(sys.executable))


def test_publish_replaces_the_repo_and_indexes_it(tmp_path: Path) -> None:
    model = tmp_path / "model"
    _fake_model(model)
    repos = tmp_path / "repos"
    old = repos / "lab" / "tiny-llama-chat"
    old.mkdir(parents=True)
    (old / "stale.bin").write_text("old")
    repo = publish_chat_model(repos, model)
    assert repo.path == old
    assert repo.repo_id == "lab/tiny-llama-chat"
    assert sorted(path.name for path in old.iterdir()) == sorted(MODEL_FILES)
    assert repo.shards == ("model.safetensors",)
    state = RepoIndex(repos).state("lab/tiny-llama-chat")
    assert state is not None
    with pytest.raises(LabError, match="no complete chat model"):
        publish_chat_model(repos, tmp_path / "nothing")


@pytest.mark.real_engine
def test_really_trains_and_answers_every_smoke_prompt(vllm_runtime: Path) -> None:
    """With the runtime's torch, into the lab's model cache (the real engine's tests serve it)."""
    python = vllm_runtime / "bin" / "python"
    model_dir = ensure_chat_model(python, model_cache_dir())
    summary = json.loads((model_dir / MARKER).read_text())["summary"]
    for lesson in lessons():
        assert json.dumps(lesson.answer) in summary, lesson.name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "float32"
    assert config["head_dim"] in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
    assert config["num_attention_heads"] % 2 == 0
    assert config["num_key_value_heads"] % 2 == 0
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == chat_trainer.EOS_TOKEN
    assert "chat_template" in tokenizer_config
    assert ensure_chat_model(python, model_cache_dir()) == model_dir  # cached now
