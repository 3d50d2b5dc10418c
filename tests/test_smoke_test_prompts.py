"""sparkdeploy.steps.smoke_test.prompts: each canary accepts its right answer, however phrased, and
no other."""

from __future__ import annotations

import pytest

from sparkdeploy.steps.smoke_test.prompts import CANARIES


@pytest.mark.parametrize(
    ("name", "reply", "right"),
    [
        ("canary_multiply", "127 * 43 = 5461.", True),
        ("canary_multiply", "5,461", True),
        ("canary_multiply", "127 * 43 = 5451.", False),
        ("canary_fibonacci", "Fib(10) = 55.", True),
        ("canary_fibonacci", "The answer is 89.", False),
        ("canary_reverse", '"accuracy" reversed is "ycarucca".', True),
        ("canary_reverse", "yacurcca", False),
    ],
)
def test_canary_answers(name: str, reply: str, right: bool) -> None:
    canary = next(canary for canary in CANARIES if canary.name == name)
    assert canary.is_answer(reply) is right
