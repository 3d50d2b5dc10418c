"""The typo-rate eval's judge: which words it checks, and its false-positive rate on clean text
and its catch rate on typos, measured (the figures in docs/quality.md#the-word-list)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from lab.engine.standin_answers import answer, misspell
from sparkdeploy.steps.quality.prompts import TYPO_PROMPTS
from sparkdeploy.steps.quality.spelling import (
    checkable_words,
    is_known,
    known_words,
    spelling,
    typo_rate,
)

ROOT = Path(__file__).resolve().parents[1]
# Everyday English prose that no model wrote: the licence texts every Debian system ships
# (base-files), 9,652 checked words.
LICENCES = Path("/usr/share/common-licenses")
CLEAN_PROSE = ("GPL-3", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic", "CC0-1.0")


def test_the_word_list_is_shipped_and_lowercase() -> None:
    words = known_words()
    assert len(words) > 60_000
    assert {"lighthouse", "colour", "color", "don't"} <= words
    assert all(word == word.lower() and not word.endswith("'s") for word in words)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("The keeper's lamp, polished.", ["keeper's", "lamp", "polished"]),
        ("A well-known sea-faring town", ["well", "known", "sea", "faring", "town"]),
        ("Paris and NASA and GPUs and vLLM", ["and", "and", "and"]),
        ("so run `pip install foo` then ```\ncode here\n``` done", ["run", "then", "done"]),
        ("see https://example.org/a-b or www.x.org or a@b.org now", ["see", "now"]),
        ("It costs 42 dollars, 3x more, v0.32, e.g. recipe.toml", ["costs", "dollars", "more"]),
        ("snake_case and a/b paths and --flags", ["and", "paths", "and"]),
        ("«Quoted» (bracketed) **bold** “curly”!", ["bracketed", "bold", "curly"]),
        ("Ok, so it is an ox", []),
        ("日本語 text", ["text"]),
    ],
)
def test_which_words_are_checked(text: str, words: list[str]) -> None:
    assert checkable_words(text) == words


@pytest.mark.parametrize(
    "word",
    ["keeper's", "keepers'", "polished", "stopped", "happily", "deterministically", "colour"],
)
def test_inflections_and_possessives_are_known(word: str) -> None:
    assert is_known(word, known_words())


@pytest.mark.parametrize("word", ["teh", "lighhtouse", "recieve", "answres", "abuot"])
def test_typos_are_caught(word: str) -> None:
    assert not is_known(word, known_words())


def test_false_positive_rate_on_clean_prose() -> None:
    """Measured: 0.083 % (8 of 9,652 words: `licensors` x4, `sublicensable`, `declaratory`,
    `yyyy`, `merchantability`), well under the 0.2 % a recipe's bar would be set at."""
    rate, checked, misspelled = typo_rate((LICENCES / name).read_text() for name in CLEAN_PROSE)
    print(f"false positives on clean prose: {rate:.3%} of {checked} words: {misspelled}")
    assert checked > 9000
    assert rate < 0.0015


def test_false_positive_rate_on_technical_prose() -> None:
    """This project's own docs: jargon no general word list has (`repo`, `env`, `teardown`,
    `config`...) makes about 2.5 %: why the eval's prompts ask for everyday prose."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    rate, checked, _ = typo_rate(path.read_text() for path in docs)
    print(f"false positives on the project's docs: {rate:.2%} of {checked} words")
    assert checked > 5000
    assert rate < 0.05


def test_catch_rate_on_typos() -> None:
    """One typo (two letters swapped, one replaced, dropped or added) in each of 3,000 known words
    of four letters or more from the clean prose: measured, 95 % are caught; the rest make another
    word ("form" -> "from")."""
    words = known_words()
    source = [
        word
        for name in CLEAN_PROSE
        for word in checkable_words((LICENCES / name).read_text())
        if len(word) >= 4 and is_known(word, words)
    ]
    rng = random.Random(26)
    letters = "abcdefghijklmnopqrstuvwxyz"
    caught = changed = 0
    for word in rng.sample(source, 3000):
        i = rng.randrange(1, len(word) - 1)
        typo = rng.choice(
            [
                word[:i] + word[i + 1] + word[i] + word[i + 2 :],
                word[:i] + rng.choice(letters) + word[i + 1 :],
                word[:i] + word[i + 1 :],
                word[:i] + rng.choice(letters) + word[i:],
            ]
        )
        if typo != word:
            changed += 1
            caught += not is_known(typo, words)
    print(f"typos caught: {caught / changed:.1%} of {changed}")
    assert caught / changed > 0.9


def test_the_standins_answers_are_clean_and_its_typos_are_caught() -> None:
    """The lab's engine (lab/engine/standin_answers.py) answers the typo prompts without a
    misspelling, and its `typos` fault's answers are caught word by word."""
    for prompt in TYPO_PROMPTS:
        clean = spelling(answer(prompt))
        assert clean.misspelled == (), (prompt, clean)
        broken = spelling(misspell(answer(prompt)))
        assert broken.checked == clean.checked
        assert len(broken.misspelled) >= broken.checked // 4, broken
