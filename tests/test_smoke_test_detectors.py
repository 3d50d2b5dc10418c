"""sparkdeploy.steps.smoke_test.detectors on literal texts: healthy ones raise no finding, loops,
garbled text and a copy with changes are named."""

from __future__ import annotations

import pytest

from sparkdeploy.steps.smoke_test.detectors import (
    copied_share,
    copy_mismatches,
    detect_garbled,
    detect_repetition,
    function_word_ratio,
    numbers_in,
    odd_word_reason,
    repeated_ngram_ratio,
)
from sparkdeploy.steps.smoke_test.prompts import COPY_SENTENCE

GOOD_PROSE = (
    "A lighthouse helps ships at night by shining a powerful beam of light that sailors can see "
    "from many miles away. Each lighthouse flashes in its own pattern, so a crew can tell exactly "
    "where they are along the coast. The light also warns them away from rocks, reefs and shallow "
    "water that could wreck the ship."
)
GOOD_LIST = (
    "Here are the steps:\n1. Trim the wick and clean the lens.\n2. Wind the clockwork that turns "
    "the light.\n3. Record the wind, the swell and any fog in the log.\n4. Start the foghorn if "
    "visibility drops below one mile."
)
GOOD_REASONING = (
    "The user asks for 127*43. 127*40 = 5080 and 127*3 = 381, so 5080 + 381 = 5461. Let me check: "
    "43*127 = 43*100 + 43*27 = 4300 + 1161 = 5461. The answer is 5461."
)
GOOD_TEXTS = [GOOD_PROSE, GOOD_LIST, GOOD_REASONING, "5461", "Fib(10) = 55.", "ycarucca", ""]


@pytest.mark.parametrize("text", GOOD_TEXTS)
def test_healthy_texts_raise_no_finding(text: str) -> None:
    assert detect_repetition(text) is None
    assert detect_garbled(text) is None


def test_repeated_ngram_ratio_is_zero_for_fresh_and_high_for_loops() -> None:
    assert repeated_ngram_ratio(list("abcdefgh"), 4) == 0.0
    assert repeated_ngram_ratio(("x y " * 20).split(), 4) > 0.9
    assert repeated_ngram_ratio(["a", "b"], 4) == 0.0


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 5461. " * 12,
        "The answer" + " of the" * 100,
        GOOD_PROSE + " and the ship and the ship" * 12,  # a loop that starts late
        "5461" * 30,  # one long token
        "然后" * 40,
    ],
)
def test_token_loops_are_found(text: str) -> None:
    finding = detect_repetition(text)
    assert finding is not None
    assert "loop" in finding


def test_loop_evidence_quotes_the_repeated_phrase() -> None:
    finding = detect_repetition("The answer" + " of the" * 100)
    assert finding is not None
    assert "'of the of the'" in finding


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        # vowels dropped: words no language has
        (
            "Th lghthse hlps shps t nght by shnng brght bm f lght tht slrs cn s frm mls wy.",
            "not words",
        ),
        # letters swapped plus a stray Latin-1 capital, the stand-in's and a real broken head's
        ("Yuo aksdeÃ aobtuÃ trheeÃ, sneetcnseÃ, epxalniÃ, lgithohsueÃ, hlespÃ.", "mojibake"),
        ("The lighthouse\u2019s lamp is visible from 20 kmâ€™s away; itâ€™s bright.", "mojibake"),
        # real words, no grammar
        (
            "rock beam coast ship light sailor reef lantern night keeper tower brass lens wave "
            "storm harbour signal flash pattern fog horn",
            "word salad",
        ),
        (
            "Yuo aksde aobtu trhee sneetcnse epxalni lgithohsue hlesp Tihs rpeyl cmose form teh "
            "lba egnnie satdn wihhc asnewsr eevyr porpmt dtereimintscilayl",
            "word salad",
        ),
        ("The light \ufffd\ufffd helps ships", "replacement character"),
    ],
)
def test_garbled_texts_are_found(text: str, kind: str) -> None:
    finding = detect_garbled(text)
    assert finding is not None
    assert kind in finding


@pytest.mark.parametrize(
    ("word", "reason"),
    [
        ("lghths", "no vowel"),
        ("Мoscow", "mixed scripts"),  # Cyrillic М
        ("heeelp", "letter tripled"),
        ("tHeLight", "case flips inside the word"),
        ("angstrngth", "six consonants in a row"),
        ("strengths", None),
        ("rhythm", None),
        ("NATO", None),
        ("naïve", None),
        ("McDonald", None),
    ],
)
def test_odd_word_rules(word: str, reason: str | None) -> None:
    assert odd_word_reason(word) == reason


def test_function_word_ratio_of_prose_and_salad() -> None:
    assert function_word_ratio(GOOD_PROSE.split()) > 0.3
    assert function_word_ratio(["rock", "beam", "coast", "ship", "light"]) == 0.0


def test_copy_mismatches_names_typos_and_ignores_framing() -> None:
    assert copy_mismatches(COPY_SENTENCE, COPY_SENTENCE) == []
    assert copy_mismatches(COPY_SENTENCE, f'Sure! "{COPY_SENTENCE}" Anything else?') == []
    typos = COPY_SENTENCE.replace("carefully", "carefuly").replace("enormous", "enormus")
    assert copy_mismatches(COPY_SENTENCE, typos) == [
        "'carefully' -> 'carefuly'",
        "'enormous' -> 'enormus'",
    ]
    assert copy_mismatches(COPY_SENTENCE, "The lighthouse keeper.")  # most of it dropped


def test_copied_share_tells_a_copy_with_typos_from_no_copy() -> None:
    typo = COPY_SENTENCE.replace("carefully", "carefuly")
    assert copied_share(COPY_SENTENCE, typo) == pytest.approx(12 / 13)
    assert copied_share(COPY_SENTENCE, "You asked about repeat, following, sentence.") < 0.5


def test_numbers_in_drops_thousands_separators() -> None:
    assert numbers_in("1,164,369 tokens and -3") == ["1164369", "-3"]
