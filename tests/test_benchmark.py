"""The serving benchmark against a local engine stand-in (no lab): prompts sized by the engine's
count, exactly output_tokens per request, the figures of each level, the engine's own count
beside ours, levels bounded by max-num-seqs, the raw JSON, the table and the chart."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.testing.standin_process import SERVED, local_standin
from sparkdeploy.errors import BenchmarkError
from sparkdeploy.report.benchmark_figures import Spread, percentile
from sparkdeploy.report.chart import nice_axis
from sparkdeploy.steps.benchmark import (
    BenchmarkResult,
    BenchmarkSettings,
    levels_for,
    run_benchmark,
    save_raw,
)
from sparkdeploy.steps.benchmark_depth import DEPTH_HEADROOM_TOKENS
from sparkdeploy.steps.benchmark_requests import synthetic_prompt
from sparkdeploy.steps.smoke_test import SmokeSettings

SETTINGS = BenchmarkSettings(
    concurrency=[1, 3, 8], input_tokens=40, output_tokens=12, requests_per_level=6, repeats=2
)


@pytest.fixture(scope="module")
def result() -> Iterator[BenchmarkResult]:
    with local_standin(env={"STANDIN_DECODE_DELAY_S": "0.002"}) as endpoint:
        yield run_benchmark(SmokeSettings(endpoint, SERVED), SETTINGS, max_num_seqs=4)


def test_the_prompt_is_sized_by_the_engines_count(result: BenchmarkResult) -> None:
    # the stand-in counts a word as a token, plus 6 for the chat template
    assert (result.prompt.target, result.prompt.counted, result.prompt.words) == (40, 40, 34)
    for level in result.levels:
        assert level.figures()["prompt_tokens_mean"].value == 40


def test_levels_above_max_num_seqs_are_lowered_to_it(result: BenchmarkResult) -> None:
    assert [level.concurrency for level in result.levels] == [1, 3, 4]
    assert result.lowered == "level(s) 8 lowered to 4, the recipe's --max-num-seqs"
    assert levels_for([16, 1, 4, 4], None) == ([1, 4, 16], None)


def test_every_request_decodes_output_tokens_and_the_engine_agrees(
    result: BenchmarkResult,
) -> None:
    for level in result.levels:
        assert len(level.runs) == SETTINGS.repeats
        for run in level.runs:
            assert len(run.samples) == max(SETTINGS.requests_per_level, level.concurrency)
            assert {sample.output_tokens for sample in run.samples} == {12}
            assert all(sample.ok and len(sample.itl_s) == 11 for sample in run.samples)
            assert run.engine is not None
            assert run.engine.requests_finished == len(run.samples)
    assert result.engine_disagreements() == []


def test_each_level_has_every_figure_with_its_spread(result: BenchmarkResult) -> None:
    for level in result.levels:
        figures = level.figures()
        assert figures["errors"].value == 0
        assert figures["ttft_p50_s"].value <= figures["ttft_p90_s"].value
        assert figures["ttft_p90_s"].value <= figures["ttft_p99_s"].value
        # The stand-in waits 2 ms before each token after the first: a request lasts at least
        # that long however its chunks bunch up on a busy client (which shrinks the gaps, ITL).
        assert figures["e2e_p50_s"].value >= 0.002 * (SETTINGS.output_tokens - 1)
        assert figures["itl_p90_s"].value > 0
        assert figures["output_tok_s"].value > 0
        assert figures["requests_s"].value > 0
        assert figures["engine_generation_tokens"].value == 12 * 6
        assert figures["client_cpu_ms_per_request"].value > 0
        assert len(figures["e2e_p50_s"].values) == SETTINGS.repeats


def test_decode_at_a_context_depth_is_measured_within_max_model_len(
    result: BenchmarkResult,
) -> None:
    # the stand-in's model has max_model_len 4096: 8192 is lowered to what leaves room for
    # the 12 output tokens and the headroom
    room = 4096 - 12 - DEPTH_HEADROOM_TOKENS
    assert [(depth.depth, depth.context) for depth in result.depths] == [(0, 0), (8192, room)]
    assert result.depths_lowered is not None
    assert result.depths_lowered.startswith(f"depth 8192 measured at {room}: the engine's ")
    figures = result.depth_figures()
    assert figures[8192]["depth_context_tokens"].value == room  # sized by the engine's count
    assert figures[0]["depth_context_tokens"].value == 7  # one word and the chat template
    for depth in (0, 8192):
        assert figures[depth]["depth_errors"].value == 0
        assert figures[depth]["depth_decode_tok_s"].value > 0
        assert len(figures[depth]["depth_decode_tok_s"].values) == SETTINGS.repeats
    assert "| figure | d=0 | d=8192 |" in result.markdown()


def test_the_client_check_is_stated(result: BenchmarkResult) -> None:
    check = result.client_check
    assert check.concurrency == 4
    text = check.text()
    assert text.startswith("client CPU ")
    assert "at concurrency 4" in text
    assert "not the bottleneck" in text or "may be the bottleneck" in text


def test_raw_json_beside_the_logs_and_the_artifacts(
    result: BenchmarkResult, tmp_path: Path
) -> None:
    path = save_raw(result, str(tmp_path), "lab-single-0123abcd")
    assert path.parent == tmp_path / "lab-single-0123abcd"
    assert path.name.startswith("benchmark-")
    assert path.suffix == ".json"
    raw = json.loads(path.read_text())
    assert raw["settings"] == SETTINGS.model_dump()
    assert len(raw["levels"][0]["runs"][0]["samples"]) == 6
    rows = result.table_rows()
    assert [row["concurrency"] for row in rows] == ["1", "3", "4"]
    assert rows[0]["errors"] == "0"
    markdown = result.markdown(str(path))
    assert "![throughput and latency against concurrency](data:image/svg+xml;base64," in markdown
    assert str(path) in markdown
    assert "| TTFT p99 (ms) |" in markdown
    ElementTree.fromstring(result.chart_svg())  # well-formed SVG


def test_an_endpoint_that_does_not_answer_is_a_named_error() -> None:
    with pytest.raises(BenchmarkError, match=r"sizing the prompt at http://127.0.0.1:9: .*refused"):
        run_benchmark(SmokeSettings("http://127.0.0.1:9", "x", request_timeout_s=2), SETTINGS)


def test_percentiles_spreads_prompts_and_axes() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5  # numpy's linear
    assert percentile(list(map(float, range(101))), 0.99) == pytest.approx(99.0)
    spread = Spread.of([10.0, 14.0, 11.0])
    assert (spread.value, spread.spread) == (11.0, 2.0)
    assert synthetic_prompt(5, 1) == synthetic_prompt(5, 1) != synthetic_prompt(5, 2)
    assert len(synthetic_prompt(7, 3).split()) == 7
    assert nice_axis(0.3) == (0.4, 4)
    assert nice_axis(4.5) == (5, 5)
    assert nice_axis(150) == (200, 4)
