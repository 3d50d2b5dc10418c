"""The engine's /metrics read as real vLLM 0.32 exports it (its page after 5 requests is
tests/fixtures/vllm-0.32-cpu/metrics.txt): counters, histograms, differences between scrapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkdeploy.vllm.metrics import (
    COUNTERS,
    HISTOGRAMS,
    EngineMetrics,
    Histogram,
    beside_ours,
    parse_metrics,
    parse_samples,
)

REAL_PAGE = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu" / "metrics.txt"


def test_the_real_engines_page_has_every_figure_we_read() -> None:
    metrics = parse_metrics(REAL_PAGE.read_text())
    assert metrics.missing == ()
    # 5 requests: 1 stopped, 4 at max_tokens (the fixture's README says which)
    assert metrics.requests_finished == 5
    assert (metrics.prompt_tokens, metrics.generation_tokens) == (298, 142)
    assert (metrics.prefix_cache_queries, metrics.prefix_cache_hits) == (298, 0)
    assert metrics.preemptions == 0
    assert metrics.ttft.count == 5
    assert metrics.ttft.sum == pytest.approx(1.977, abs=1e-3)
    assert metrics.itl.count == 142 - 5  # one gap per token after each request's first
    assert metrics.e2e.count == 5
    # 2 of the 5 first tokens came within 0.25 s, 4 within 0.5 s, all 5 within 1 s
    assert metrics.ttft.quantile(0.4) == pytest.approx(0.25)
    assert 0.25 < (metrics.ttft.quantile(0.5) or 0) < 0.5
    assert 0.75 < (metrics.ttft.quantile(0.99) or 0) <= 1.0


def test_a_page_without_the_stat_logger_names_what_is_missing() -> None:
    metrics = parse_metrics('python_info{version="3.11"} 1.0\n')
    assert set(metrics.missing) == {*COUNTERS, *HISTOGRAMS}
    assert metrics.figures() == {}


def test_the_difference_of_two_scrapes_is_what_happened_between_them() -> None:
    before = EngineMetrics(
        prompt_tokens=100,
        generation_tokens=50,
        requests_finished=2,
        prefix_cache_queries=100,
        prefix_cache_hits=0,
        ttft=Histogram(((0.1, 1), (1.0, 2), (float("inf"), 2)), 0.6, 2),
    )
    after = EngineMetrics(
        prompt_tokens=400,
        generation_tokens=250,
        requests_finished=6,
        prefix_cache_queries=400,
        prefix_cache_hits=150,
        preemptions=1,
        ttft=Histogram(((0.1, 4), (1.0, 6), (float("inf"), 6)), 1.4, 6),
    )
    activity = after.minus(before)
    assert activity.figures() == {
        "prompt_tokens": 300,
        "generation_tokens": 200,
        "requests_finished": 4,
        "preemptions": 1,
        "prefix_cache_hit_rate": 0.5,
        "ttft_mean_s": pytest.approx(0.2),
    }
    assert activity.ttft.buckets == ((0.1, 3), (1.0, 4), (float("inf"), 4))
    rows = beside_ours(activity, {"generation_tokens": 200, "requests_finished": 4})
    by_name = {row.name: row for row in rows}
    assert by_name["generation_tokens"].text() == "engine 200, ours 200"
    assert by_name["itl_mean_s"].text() == "engine not exported"


def test_label_values_with_escaped_quotes_and_braces_parse() -> None:
    [sample] = parse_samples('vllm:x_total{model_name="a \\"b\\" {c}",engine="0"} 3.5 1700000000\n')
    assert sample.labels == {"model_name": 'a \\"b\\" {c}', "engine": "0"}
    assert sample.value == 3.5


def test_quantile_of_an_empty_histogram_is_none_and_past_the_last_bound_is_that_bound() -> None:
    assert Histogram().quantile(0.5) is None
    tail = Histogram(((1.0, 1), (float("inf"), 4)), 10.0, 4)
    assert tail.quantile(0.99) == 1.0
