"""Misspelled words in a model's answer: the typo-rate eval's judge.

A word is misspelled when neither it nor its stem (an inflection's suffix taken off) is in the
word list shipped beside this module (english_words.txt.gz: SCOWL's American and British lists
as Debian's wamerican and wbritish packages ship them, docs/quality.md#the-word-list). Only
words a list can judge are checked (`checkable_words`): code, URLs, numbers, names, acronyms and
identifiers are skipped, so a technical answer is not counted as typos. The false-positive rate
of these rules on clean prose is measured by tests/test_quality_spelling.py.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

WORD_LIST = Path(__file__).with_name("english_words.txt.gz")
# Shorter words are skipped: too many two-letter abbreviations and interjections are fine.
MIN_LETTERS = 3

_FENCED_CODE = re.compile(r"```.*?(?:```|\Z)", re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_URL = re.compile(r"\b(?:[a-z][a-z0-9+.-]*://|www\.)\S+", re.I)
_EMAIL = re.compile(r"\S+@\S+")
# What a token may carry around its word: quotes, brackets, sentence punctuation, emphasis.
_EDGE_PUNCTUATION = "\"'“”‘’«»()[]{}<>.,;:!?*_…"
# Inside a word, anything but letters, hyphens and apostrophes makes it an identifier, a path,
# a number or markup: nothing a word list judges.
_WORD = re.compile(r"[^\W\d_]+(?:['’-][^\W\d_]+)*['’]?")
_LATIN = re.compile(r"[A-Za-zÀ-ÖØ-öø-ÿ'’-]+")
# Inflections and derivations whose stem the list holds when the word itself is missing:
# (suffix, what replaces it), tried in order.
_SUFFIXES = (
    ("'s", ""),
    ("s'", "s"),
    ("ally", "al"),
    ("ally", ""),
    ("ily", "y"),
    ("ly", ""),
    ("ness", ""),
    ("ment", ""),
    ("ments", ""),
    ("ation", "e"),
    ("ation", ""),
    ("ations", "e"),
    ("ations", ""),
    ("ization", "ize"),
    ("isation", "ise"),
    ("able", ""),
    ("able", "e"),
    ("ing", ""),
    ("ing", "e"),
    ("ed", ""),
    ("ed", "e"),
    ("es", ""),
    ("s", ""),
    ("er", ""),
    ("ers", ""),
    ("ers", "e"),
    ("er", "e"),
    ("est", ""),
    ("ies", "y"),
    ("ied", "y"),
    ("ier", "y"),
    ("iest", "y"),
)
_PREFIXES = ("un", "re", "pre", "non", "multi", "sub", "over", "under", "mis", "co", "de")


@dataclass(frozen=True)
class Spelling:
    """A text's words that were checked, and those of them the list does not know."""

    checked: int
    misspelled: tuple[str, ...]


@cache
def known_words() -> frozenset[str]:
    """The shipped word list: one lowercase word a line."""
    with gzip.open(WORD_LIST, "rt", encoding="utf-8") as lines:
        return frozenset(line.strip() for line in lines if line.strip())


def _without_markup(text: str) -> str:
    for pattern in (_FENCED_CODE, _INLINE_CODE, _URL, _EMAIL):
        text = pattern.sub(" ", text)
    return text


def checkable_words(text: str) -> list[str]:
    """The words of `text` a word list can judge, lowercased, hyphenated ones split.

    Skipped: code (fenced or in backticks), URLs and e-mail addresses, every token holding a
    digit or a character other than a letter, hyphen or apostrophe (paths, identifiers, figures,
    `e.g.`), capitalized words (names, and a sentence's first word with them), words with a
    capital inside (acronyms, camelCase), words not in the Latin script, and words (or parts)
    shorter than MIN_LETTERS letters.
    """
    words = []
    for token in _without_markup(text).split():
        token = token.strip(_EDGE_PUNCTUATION)
        if not token or not _WORD.fullmatch(token) or not _LATIN.fullmatch(token):
            continue
        if any(char.isupper() for char in token):
            continue
        for part in token.replace("’", "'").split("-"):
            part = part.strip("'")
            if len(part) >= MIN_LETTERS:
                words.append(part)
    return words


def is_known(word: str, words: frozenset[str]) -> bool:
    """Whether `word` (lowercase) is in `words`, itself or as an inflection of a word there."""
    if word in words:
        return True
    for suffix, replacement in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= MIN_LETTERS:
            stem = word[: -len(suffix)] + replacement
            if stem in words or (_doubled(stem) and stem[:-1] in words):
                return True
    return any(word.startswith(prefix) and word[len(prefix) :] in words for prefix in _PREFIXES)


def _doubled(stem: str) -> bool:
    """`stopp` of `stopped`: a consonant doubled before the suffix."""
    return len(stem) > MIN_LETTERS and stem[-1] == stem[-2] and stem[-1] not in "aeiou"


def spelling(text: str) -> Spelling:
    words = known_words()
    checked = checkable_words(text)
    return Spelling(len(checked), tuple(word for word in checked if not is_known(word, words)))


def typo_rate(texts: Iterable[str]) -> tuple[float, int, list[str]]:
    """(misspelled words / checked words, checked words, the misspelled ones) over `texts`."""
    checked = 0
    misspelled: list[str] = []
    for text in texts:
        found = spelling(text)
        checked += found.checked
        misspelled += found.misspelled
    return (len(misspelled) / checked if checked else 0.0), checked, misspelled
