"""The built-in evals' scores, against the engine stand-in on loopback (lab/engine): a clean
engine passes each, and its fault switches make each fail, while the smoke test still passes the
`typos` fault (a build merely worse)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from lab.testing.standin_process import SERVED, local_standin
from sparkdeploy.errors import QualityFailed
from sparkdeploy.report.quality import QualityReport
from sparkdeploy.spec.quality import ExactAnswersEval, ToolCallsEval, TypoRateEval
from sparkdeploy.steps.quality.builtin import (
    exact_answers_eval,
    tool_call_problem,
    tool_calls_eval,
    typo_rate_eval,
)
from sparkdeploy.steps.quality.prompts import TOOL_REQUESTS
from sparkdeploy.steps.smoke_test import Reply, SmokeSettings, chat, run_smoke

TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def clean() -> Iterator[SmokeSettings]:
    with local_standin(*TOOL_FLAGS) as endpoint:
        yield SmokeSettings(endpoint, SERVED, tool_calls=True)


def test_a_clean_engine_passes_every_builtin_eval(clean: SmokeSettings) -> None:
    typos = typo_rate_eval(clean, TypoRateEval(max_typo_rate=0.002, samples=8))
    assert typos.passed, typos
    assert typos.score == 0.0, typos
    assert typos.samples == 8, typos
    assert typos.evidence.startswith("0 of ")
    assert typos.unit == "rate"
    answers = exact_answers_eval(clean, ExactAnswersEval(min_score=100))
    assert answers.passed, answers
    assert answers.score == 100.0, answers
    assert answers.samples == 12, answers
    tools = tool_calls_eval(clean, ToolCallsEval(min_score=100))
    assert tools.passed, tools
    assert tools.score == 100.0, tools
    assert tools.samples == len(TOOL_REQUESTS)
    report = QualityReport(SERVED, clean.base_url, (typos, answers, tools))
    report.raise_if_failed()
    assert [row["result"] for row in report.table_rows()] == ["pass"] * 3
    assert report.table_rows()[0]["threshold"] == "≤ 0.20 %"


def test_typos_in_5_percent_of_answers_pass_the_smoke_test_and_fail_the_typo_rate() -> None:
    """One answer in 20 with every second long word misspelled: the smoke test's detectors see
    nothing wrong, the typo rate over 20 long answers is ten times the bar."""
    with local_standin(env={"STANDIN_FAULT": "typos:0.05"}) as endpoint:
        settings = SmokeSettings(endpoint, SERVED)
        smoke = run_smoke(settings)
        assert smoke.passed, smoke.failed
        typos = typo_rate_eval(settings, TypoRateEval(max_typo_rate=0.002, samples=20))
    assert not typos.passed, typos
    assert typos.score is not None, typos
    assert typos.score > 0.01, typos
    assert typos.samples == 20
    verdict = typos.verdict()
    print(verdict)
    assert verdict.startswith(f"typo_rate {typos.score * 100:.2f} % over 20 samples: above ")
    assert "the threshold ≤ 0.20 %" in verdict
    assert "words misspelled: '" in verdict
    with pytest.raises(QualityFailed, match=r"1 of 1 evals failed:\n  typo_rate"):
        QualityReport(SERVED, endpoint, (typos,)).raise_if_failed()


def test_wrong_answers_score_what_they_get_right() -> None:
    with local_standin(env={"STANDIN_FAULT": "garbled"}) as endpoint:
        answers = exact_answers_eval(
            SmokeSettings(endpoint, SERVED), ExactAnswersEval(min_score=90, samples=4)
        )
    assert answers.score == 0.0
    assert answers.samples == 4
    assert not answers.passed
    assert answers.evidence.startswith("0 of 4 right; What is 127*43? expected 5461, got ")


def test_tool_calls_refused_by_the_engine_leave_no_score() -> None:
    """Without --enable-auto-tool-choice vLLM answers 400: the endpoint failed, not the model."""
    with local_standin() as endpoint:
        tools = tool_calls_eval(SmokeSettings(endpoint, SERVED), ToolCallsEval(min_score=50))
    assert tools.score is None
    assert not tools.passed
    assert tools.error is not None
    assert "HTTP 400" in tools.error
    assert tools.verdict().startswith("tool_calls: no score: 8 of 8 requests got no answer")


def _call(name: str, arguments: str) -> Reply:
    return Reply("t", tool_calls=[{"function": {"name": name, "arguments": arguments}}])


@pytest.mark.parametrize(
    ("reply", "problem"),
    [
        (Reply("t", content="It is sunny."), "no tool call (content 'It is sunny.')"),
        (_call("get_time", "{}"), "called 'get_time', which was not offered"),
        (_call("set_timer", '{"minutes": 5}'), "called 'set_timer', not 'get_weather'"),
        (_call("get_weather", "{city: Paris}"), "get_weather: arguments are not JSON"),
        (_call("get_weather", "{}"), "get_weather({}): 'city' is a required property"),
        (_call("get_weather", '{"city": 7}'), "7 is not of type 'string'"),
        (_call("get_weather", '{"city": "Paris", "day": 1}'), "Additional properties"),
        (_call("get_weather", json.dumps({"city": "Paris"})), None),
    ],
)
def test_a_tool_call_is_valid_when_it_names_the_tool_and_matches_its_schema(
    reply: Reply, problem: str | None
) -> None:
    found = tool_call_problem(TOOL_REQUESTS[0], reply)
    assert found == problem if problem is None else problem in str(found)


def test_the_typos_switch_misspells_its_share_of_free_text_answers_only() -> None:
    """typos:0.5: every second free-text answer, counted from the engine's start; a canary's
    answer and a sentence to repeat are never touched."""
    with local_standin(env={"STANDIN_FAULT": "typos:0.5"}) as endpoint:
        settings = SmokeSettings(endpoint, SERVED)
        free = [chat(settings, "free", "Describe a quiet harbour town.").content for _ in range(4)]
        canaries = [chat(settings, "canary", "What is 127*43?").content for _ in range(3)]
    clean = "You asked about describe, quiet, harbour, town."
    assert [answer.startswith(clean) for answer in free] == [True, False, True, False]
    assert free[1].startswith("You asked abuot describe, queit, harbour,")
    assert canaries == ["127 * 43 = 5461."] * 3
