"""The detectors: pure functions of a text that name a token loop, garbled text or a copy with
changes, so they are tested on literal examples."""

from __future__ import annotations

import difflib
import re
import unicodedata
import zlib
from collections import Counter
from collections.abc import Sequence

_TOKEN = re.compile(r"\w+|[^\w\s]")
_WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)*")
LOOP_NGRAM = 4
LOOP_MIN_TOKENS = 16
LOOP_TAIL_TOKENS = 48
LOOP_RATIO = 0.5
# Text without spaces (a loop of one long token, CJK) is judged on characters.
LOOP_CHAR_NGRAM = 8
LOOP_MIN_CHARS = 64

GARBLED_MIN_WORDS = 10
GARBLED_ODD_WORD_RATIO = 0.15
SALAD_MIN_WORDS = 20
SALAD_FUNCTION_WORD_RATIO = 0.12
# UTF-8 read as Latin-1/cp1252 ("Ã©", "â€™", "Â°"), or a Latin-1 capital stuck to a lowercase
# word ("wordÃ"): never in a healthy model's English.
_MOJIBAKE = re.compile(r"Ã[\u0080-\u00bf]|â€|Â[\u00a0-\u00bf]|[a-zß-ÿ][À-Þ]")
MOJIBAKE_MIN_HITS = 2
_VOWELS = set("aeiouyàáâäèéêëìíîïòóôöùúûü")
# English prose is about 40 % these words; token salad from a broken LM head has almost none.
FUNCTION_WORDS = frozenset(
    """a about above after again against all also an and any are as at be because been before
    being below between both but by can could did do does doing down during each few for from
    further had has have having he her here hers herself him himself his how i if in into is it
    its itself just me more most my myself no nor not now of off on once only or other our ours
    out over own same she should so some such than that the their theirs them then there these
    they this those through to too under until up very was we were what when where which while
    who whom why will with would you your yours""".split()  # noqa: SIM905 (a list would be 120 lines)
)


def repeated_ngram_ratio(tokens: Sequence[str], n: int) -> float:
    """Share of the n-grams of `tokens` that repeat an earlier one: 0 for fresh text, ~1 for a
    loop."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def detect_repetition(text: str) -> str | None:
    """Evidence of a degenerate loop in `text`, or None.

    Judged on word-level 4-grams over the whole text and over its tail (a loop that starts late
    in a long answer), or on character 8-grams when the text has few word boundaries.
    """
    tokens = [token.lower() for token in _TOKEN.findall(text)]
    if len(tokens) >= LOOP_MIN_TOKENS:
        for scope, window in (("reply", tokens), ("tail", tokens[-LOOP_TAIL_TOKENS:])):
            ratio = repeated_ngram_ratio(window, LOOP_NGRAM)
            if ratio >= LOOP_RATIO:
                gram, count = Counter(
                    tuple(window[i : i + LOOP_NGRAM]) for i in range(len(window) - LOOP_NGRAM + 1)
                ).most_common(1)[0]
                return (
                    f"token loop: {ratio:.0%} of the {scope}'s {LOOP_NGRAM}-grams repeat; "
                    f"{' '.join(gram)!r} x{count}"
                )
        return None
    stripped = "".join(text.split())
    if len(stripped) >= LOOP_MIN_CHARS:
        ratio = repeated_ngram_ratio(stripped, LOOP_CHAR_NGRAM)
        if ratio >= LOOP_RATIO:
            compressed = len(zlib.compress(stripped.encode())) / len(stripped.encode())
            return (
                f"character loop: {ratio:.0%} of {LOOP_CHAR_NGRAM}-character runs repeat "
                f"(compresses to {compressed:.0%})"
            )
    return None


def _script(char: str) -> str:
    name = unicodedata.name(char, "")
    return name.split(" ", 1)[0] if name else "UNKNOWN"


def odd_word_reason(word: str) -> str | None:
    """Why `word` cannot be a word of natural text, or None. Rules, not a dictionary."""
    if any(char == "\ufffd" or unicodedata.category(char) in ("Co", "Cn", "Cs") for char in word):
        return "broken character"
    letters = [char for char in word if char.isalpha()]
    if len({_script(char) for char in letters}) > 1:
        return "mixed scripts"
    if not all(char.isascii() for char in letters):
        return None
    lower = word.lower()
    if re.search(r"(.)\1\1", lower):
        return "letter tripled"
    if len(lower) >= 4 and not _VOWELS.intersection(lower) and not word.isupper():
        return "no vowel"
    if re.search(r"[^aeiouy'’]{6}", lower):
        return "six consonants in a row"
    if re.fullmatch(r"[a-z]+[A-Z]+[a-z]+[A-Z]+.*", word):
        return "case flips inside the word"
    return None


def function_word_ratio(words: Sequence[str]) -> float:
    if not words:
        return 0.0
    return sum(word.lower() in FUNCTION_WORDS for word in words) / len(words)


def detect_garbled(text: str) -> str | None:
    """Evidence that `text` is garbled (broken characters, mojibake, non-words, word salad)."""
    if "\ufffd" in text:
        return f"{text.count(chr(0xFFFD))} replacement character(s) (U+FFFD): broken decoding"
    mojibake = _MOJIBAKE.findall(text)
    if len(mojibake) >= MOJIBAKE_MIN_HITS:
        return f"mojibake: {len(mojibake)} encoding artefacts like {mojibake[:3]}"
    words = words_in(text)
    if len(words) < GARBLED_MIN_WORDS:
        return None
    odd = [(word, reason) for word in words if (reason := odd_word_reason(word))]
    ratio = len(odd) / len(words)
    if ratio >= GARBLED_ODD_WORD_RATIO:
        examples = ", ".join(f"{word!r} ({reason})" for word, reason in odd[:4])
        return f"{ratio:.0%} of {len(words)} words are not words: {examples}"
    if len(words) >= SALAD_MIN_WORDS:
        share = function_word_ratio(words)
        if share < SALAD_FUNCTION_WORD_RATIO:
            return (
                f"word salad: only {share:.0%} of {len(words)} words are English function words "
                f"(prose has ~40%): {' '.join(words[:8])!r}..."
            )
    return None


def copy_mismatches(expected: str, reply: str) -> list[str]:
    """Words of `expected` the reply changed or dropped, as "'was' -> 'now'" strings.

    Words before and after the copy ("Sure, here it is: ...") do not count.
    """
    want = [word.lower() for word in words_in(expected)]
    got = [word.lower() for word in words_in(reply)]
    matcher = difflib.SequenceMatcher(a=want, b=got, autojunk=False)
    return [
        f"{' '.join(want[a0:a1])!r} -> {' '.join(got[b0:b1])!r}"
        for tag, a0, a1, b0, b1 in matcher.get_opcodes()
        if tag != "equal" and not (tag == "insert" and a0 in (0, len(want)))
    ]


def copied_share(expected: str, reply: str) -> float:
    """Share of the words of `expected` that the reply has, in order."""
    want = [word.lower() for word in words_in(expected)]
    got = [word.lower() for word in words_in(reply)]
    matcher = difflib.SequenceMatcher(a=want, b=got, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks()) / max(len(want), 1)


def words_in(text: str) -> list[str]:
    """The words of `text`: letters, with inner apostrophes ("don't"); no digits."""
    return _WORD.findall(text)


def numbers_in(text: str) -> list[str]:
    return [number.replace(",", "") for number in re.findall(r"-?\d[\d,]*", text)]
