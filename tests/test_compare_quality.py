"""The comparison by checkpoint, by decode at a context depth and by quality (issue 26.2): a side
that swaps the model or its revision, the depth figures judged like the sweep's, each side's eval
scores over repeated runs, and the ship rule, parsed and judged."""

from __future__ import annotations

import re
from pathlib import Path
from xml.etree import ElementTree

import pytest

from sparkdeploy.errors import CompareError
from sparkdeploy.report import chart
from sparkdeploy.report.benchmark_figures import Spread, chart_panels
from sparkdeploy.report.quality import EvalResult, QualityReport
from sparkdeploy.report.ship_rule import parse_ship_rule
from sparkdeploy.report.verdicts import NoiseRule
from sparkdeploy.spec.cluster import Cluster, load_cluster
from sparkdeploy.spec.plan import make_plan
from sparkdeploy.spec.recipe import RepoRef
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.spec.recipe_variant import write_variant
from sparkdeploy.steps import compare as compare_step
from sparkdeploy.steps.benchmark import BenchmarkResult, LevelResult, LevelRun
from sparkdeploy.steps.benchmark_depth import DEPTH_HEADROOM_TOKENS, DepthResult, depths_for
from sparkdeploy.steps.benchmark_requests import PromptSize, RequestSample
from sparkdeploy.steps.compare import (
    CompareSide,
    Comparison,
    PreparedComparison,
    checkpoint_problems,
    prepare,
)
from sparkdeploy.steps.compare_outcome import SideOutcome, eval_spec
from sparkdeploy.steps.prefetch import HubAccess
from sparkdeploy.steps.prefetch.preview import RepoPreview

ROOT = Path(__file__).parent.parent
LAB = ROOT / "clusters" / "dgx-spark-4.toml"
COMPOSED = ROOT / "recipes" / "lab-dsv41-3x" / "recipe.toml"  # its composed source is its model
SINGLE = ROOT / "recipes" / "lab-single" / "recipe.toml"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return load_cluster(LAB)


# ---------------------------------------------------------------------------------------------
# A side that swaps the checkpoint


def test_a_variant_can_serve_another_checkpoint_and_its_plan_prefetches_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    recipe = load_recipe(COMPOSED)
    swapped = load_recipe(write_variant(recipe, tmp_path, model="lab/other-dsv41"))
    assert (swapped.model, swapped.model_revision) == ("lab/other-dsv41", None)
    assert swapped.composed_model is not None
    assert recipe.composed_model is not None
    assert [source.repo for source in swapped.composed_model.sources] == ["lab/other-dsv41"]
    assert swapped.composed_model.local_files == recipe.composed_model.local_files
    assert swapped.vllm_args.argv() == recipe.vllm_args.argv()
    assert swapped.env == recipe.env
    repos = make_plan(swapped, cluster, ["dgx1", "dgx2", "dgx3"]).repos
    assert RepoRef(repo="lab/other-dsv41") in repos
    assert all(ref.repo != "lab/tiny-dsv41" for ref in repos)

    pinned = load_recipe(write_variant(recipe, tmp_path, model_revision=COMMIT))
    assert (pinned.model, pinned.model_revision) == ("lab/tiny-dsv41", COMMIT)
    assert pinned.composed_model is not None
    assert pinned.composed_model.sources[0].revision == COMMIT
    plan = make_plan(pinned, cluster, ["dgx1", "dgx2", "dgx3"])
    assert RepoRef(repo="lab/tiny-dsv41", revision=COMMIT) in plan.repos
    # the engine is told the revision too (no composition: its own --revision)
    single = load_recipe(write_variant(load_recipe(SINGLE), tmp_path, model_revision=COMMIT))
    argv = make_plan(single, cluster, ["dgx1"]).head_serve_argv
    assert argv[argv.index("--revision") + 1] == COMMIT


def test_a_checkpoint_that_is_no_repo_is_named(tmp_path: Path) -> None:
    with pytest.raises(
        CompareError, match=r"(?s)side B: the overrides .*is not a Hugging Face repo id"
    ):
        write_variant(load_recipe(SINGLE), tmp_path, model="no-org", what="side B")


def test_prepare_names_the_swapped_checkpoint_in_the_diff(cluster: Cluster, tmp_path: Path) -> None:
    prepared = prepare(
        CompareSide(recipe="lab-single"),
        CompareSide(recipe="lab-single", model="lab/tiny-chat-b", model_revision="v2"),
        cluster,
        "auto",
        variants=tmp_path,
        root=ROOT,
    )
    assert prepared.a.checkpoint is None
    assert prepared.b.checkpoint == RepoRef(repo="lab/tiny-chat-b", revision="v2")
    assert prepared.b.description == "lab-single with model lab/tiny-chat-b@v2"
    changed = {(d.section, d.key): (d.a, d.b) for d in prepared.diff.differences}
    assert changed[("model", "model")] == ("lab/tiny-chat@main", "lab/tiny-chat-b@v2")


def test_a_checkpoint_the_hub_refuses_fails_the_compare_before_it_deploys(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared = prepare(
        CompareSide(recipe="lab-single", model_revision="nope"),
        CompareSide(recipe="lab-single", model="lab/gone"),
        cluster,
        "auto",
        variants=tmp_path,
        root=ROOT,
    )
    asked: list[list[RepoRef]] = []

    def preview(refs: list[RepoRef], cache_dir: Path, hub: HubAccess) -> list[RepoPreview]:
        asked.append(refs)
        return [
            RepoPreview("lab/tiny-chat", "nope", None, "unknown", 0, 0, None, "hub timed out"),
            RepoPreview("lab/gone", None, None, "refuse", 0, 0, None, "404: no such repo"),
        ]

    monkeypatch.setattr(compare_step, "preview_repos", preview)
    refused, unknown = checkpoint_problems(prepared, tmp_path, HubAccess())
    assert asked == [[RepoRef(repo="lab/tiny-chat", revision="nope"), RepoRef(repo="lab/gone")]]
    assert refused == ["side B: checkpoint lab/gone@main: 404: no such repo"]
    assert unknown == ["side A: checkpoint lab/tiny-chat@nope: hub timed out"]


# ---------------------------------------------------------------------------------------------
# Decode at a context depth


def test_depths_are_lowered_to_what_max_model_len_leaves_with_a_note() -> None:
    assert depths_for([8192, 0], None, 64) == ([(0, 0), (8192, 8192)], None)
    room = 4096 - 64 - DEPTH_HEADROOM_TOKENS
    depths, note = depths_for([0, 8192], 4096, 64)
    assert depths == [(0, 0), (8192, room)]
    assert note == (
        f"depth 8192 measured at {room}: the engine's max-model-len 4096 leaves room for {room} "
        f"tokens of context before 64 output tokens (and {DEPTH_HEADROOM_TOKENS} to spare)"
    )
    assert depths_for([], 4096, 64) == ([], None)


def sample(itl_s: float, prompt_tokens: int = 64, tokens: int = 16) -> RequestSample:
    return RequestSample(
        started_s=0.0,
        ttft_s=0.01,
        e2e_s=0.01 + itl_s * (tokens - 1),
        itl_s=(itl_s,) * (tokens - 1),
        prompt_tokens=prompt_tokens,
        output_tokens=tokens,
        client_cpu_s=0.001,
    )


def benchmark(itl_s: float, depth_itl_s: tuple[float, float, float]) -> BenchmarkResult:
    runs = tuple(
        LevelRun(1, repeat, itl_s * 32, tuple(sample(itl_s) for _ in range(4)), None)
        for repeat in range(3)
    )
    depths = (
        DepthResult(0, 0, tuple(sample(itl_s, 7) for _ in range(3))),
        DepthResult(8192, 8192, tuple(sample(itl, 8192) for itl in depth_itl_s)),
    )
    return BenchmarkResult(
        base_url="http://x",
        served_model_name="m",
        settings={},
        prompt=PromptSize(64, 58, 64),
        levels=(LevelResult(1, runs),),
        lowered=None,
        started_at="2025-01-01T00:00:00Z",
        depths=depths,
    )


def test_depth_figures_are_judged_by_the_same_noise_rules(tmp_path: Path) -> None:
    result = benchmark(0.01, (0.02, 0.021, 0.0205))
    figures = result.depth_figures()
    assert figures[8192]["depth_decode_tok_s"].value == pytest.approx(15 / (15 * 0.0205))
    assert figures[8192]["depth_context_tokens"].value == 8192
    assert figures[0]["depth_errors"].value == 0
    markdown = result.markdown()
    assert "| figure | d=0 | d=8192 |" in markdown
    assert "| decode tok/s (one request) |" in markdown
    svg = result.chart_svg()
    ElementTree.fromstring(svg)
    assert "context tokens" in svg
    assert "decode tok/s at depth" in svg
    panels = chart_panels({"A": result.figures()}, {"A": {}})
    assert [panel.x_label for panel in panels] == ["concurrency"] * 3  # no depths, no panel
    assert isinstance(panels[0], chart.Panel)


def quality(*scores: tuple[float, float]) -> tuple[QualityReport, ...]:
    """One report per run: (typo rate, exact-answer score)."""
    return tuple(
        QualityReport(
            "m",
            "http://x",
            (
                EvalResult("typo_rate", typo, 0.002, "max", 400, 3.0, "rate"),
                EvalResult("exact_answers", score, 88.0, "min", 20, 2.0, "percent"),
            ),
        )
        for typo, score in scores
    )


def side(
    label: str, depth_itl_s: tuple[float, float, float], *scores: tuple[float, float]
) -> SideOutcome:
    """A side whose requests decode at 10 ms a token, at depth at these, with these scores."""
    return SideOutcome(label, benchmark=benchmark(0.01, depth_itl_s), quality=quality(*scores))


@pytest.fixture
def prepared(cluster: Cluster, tmp_path: Path) -> PreparedComparison:
    return prepare(
        CompareSide(recipe="lab-single"),
        CompareSide(recipe="lab-single", model="lab/tiny-chat-b"),
        cluster,
        "auto",
        variants=tmp_path,
        root=ROOT,
    )


def test_eval_scores_and_depth_rows_side_by_side(prepared: PreparedComparison) -> None:
    a = side("A", (0.02, 0.02, 0.02), (0.0, 90.0), (0.0005, 91.0))
    b = side("B", (0.04, 0.041, 0.04), (0.05, 90.0), (0.048, 89.0))
    comparison = Comparison.of(prepared, a, b, NoiseRule())
    typo = comparison.row("quality", "typo_rate (≤ 0.20 %)")
    assert typo.verdict == "worse"
    assert typo.a == "0.03 % ± 0.03 % (2 runs), pass"
    assert typo.b == "4.90 % ± 0.10 % (2 runs), FAIL 2/2"
    assert comparison.row("quality", "exact_answers (≥ 88.0 %)").verdict == "same"
    assert comparison.row("d=8192", "decode tok/s (one request)").verdict == "worse"
    assert comparison.row("d=0", "decode tok/s (one request)").verdict == "same"
    assert comparison.ship is None
    assert "Noise: " in comparison.markdown()
    assert "context depth" in comparison.markdown()


# ---------------------------------------------------------------------------------------------
# The ship rule


@pytest.mark.parametrize(
    ("rule", "problem"),
    [
        ("", "ship_if is empty"),
        ("quality", "cannot read 'quality'"),
        ("decode@8192 worse", "cannot read 'decode@8192 worse'"),
        ("speed@8192 not worse", "'speed@8192' names no figure at a depth: decode, ttft"),
        ("output@c4 >= fast", "'fast' is not a number"),
    ],
)
def test_a_rule_that_cannot_be_read_is_named(rule: str, problem: str) -> None:
    with pytest.raises(CompareError, match=re.escape(problem)):
        parse_ship_rule(rule)


def test_rules_are_read_into_conditions() -> None:
    rule = parse_ship_rule(
        "quality>=88, decode@8192 not worse and ttft@d0 <= 500, output@c4 better"
    )
    assert [(c.subject.kind, c.subject.name, c.subject.at) for c in rule.conditions] == [
        ("eval", "quality", None),
        ("depth", "depth_decode_tok_s", 8192),
        ("depth", "depth_ttft_s", 0),
        ("level", "output_tok_s", 4),
    ]
    assert (rule.conditions[0].comparator, rule.conditions[0].value) == (">=", 88.0)
    assert rule.conditions[1].accepted == {"same", "better"}
    assert rule.evals == ["quality"]


def test_the_rule_names_evals_side_b_runs(cluster: Cluster, tmp_path: Path) -> None:
    recipe = tmp_path / "gated" / "recipe.toml"
    recipe.parent.mkdir()
    recipe.write_text(
        SINGLE.read_text() + "\n[quality.exact_answers]\nmin_score = 88\n"
        "\n[quality.typo_rate]\nmax_typo_rate = 0.002\n"
    )

    def prepared_with(rule: str) -> PreparedComparison:
        return prepare(
            CompareSide(recipe="lab-single"),
            CompareSide(recipe=str(recipe)),
            cluster,
            "auto",
            variants=tmp_path / "variants",
            ship_if=rule,
        )

    with pytest.raises(CompareError, match="`quality` names side B's only eval, but its"):
        prepared_with("quality >= 88")
    with pytest.raises(CompareError, match="ship_if names the eval 'hardmode', which side B"):
        prepared_with("hardmode >= 88")
    prepared = prepared_with("exact_answers >= 88, decode@8192 not worse")
    assert prepared.b.evals == ("typo_rate", "exact_answers")
    assert prepared.ship_rule is not None
    assert prepared.ship_rule.evals == ["exact_answers"]


def test_b_ships_when_every_condition_is_met(cluster: Cluster, tmp_path: Path) -> None:
    gated = tmp_path / "gated" / "recipe.toml"
    gated.parent.mkdir()
    gated.write_text(SINGLE.read_text() + "\n[quality.exact_answers]\nmin_score = 88\n")
    prepared = prepare(
        CompareSide(recipe="lab-single"),
        CompareSide(recipe=str(gated), model="lab/tiny-chat-b"),
        cluster,
        "auto",
        variants=tmp_path / "variants",
        root=ROOT,
        ship_if="exact_answers>=88, decode@8192 not worse",
    )
    a = side("A", (0.02, 0.02, 0.02), (0.0, 87.0), (0.0, 87.5))
    faster = side("B", (0.019, 0.02, 0.0195), (0.0, 88.0), (0.0, 89.0))
    shipped = Comparison.of(prepared, a, faster, NoiseRule())
    assert shipped.ship is not None
    assert shipped.ship.ships
    assert shipped.summary_line().startswith("SHIP B (exact_answers>=88, decode@8192 not worse).")
    markdown = shipped.markdown()
    assert "## Ship rule: SHIP B" in markdown
    assert "- exact_answers>=88: met (A 87.2 % ± 0.2 % (2 runs), FAIL 2/2, B 88.5 %" in markdown

    slower = side("B", (0.03, 0.031, 0.03), (0.0, 88.0), (0.0, 89.0))
    held = Comparison.of(prepared, a, slower, NoiseRule())
    assert held.ship is not None
    assert not held.ship.ships
    outcomes = {o.condition.text: o.met for o in held.ship.outcomes}
    assert outcomes == {"exact_answers>=88": True, "decode@8192 not worse": False}
    assert held.ship.headline().startswith("DO NOT SHIP B")

    failed = SideOutcome("B", failed_at="deploy", cause="crash")
    unmeasured = Comparison.of(prepared, a, failed, NoiseRule())
    assert unmeasured.ship is not None
    assert not unmeasured.ship.ships
    texts = [outcome.text() for outcome in unmeasured.ship.outcomes]
    assert texts == [
        "exact_answers>=88: NOT measured (B ran no eval 'exact_answers' (its evals: none; "
        "`quality` names its only one))",
        "decode@8192 not worse: NOT measured (B measured no decode tok/s (one request) at "
        "context depth 8192)",
    ]


def test_a_spread_of_scores_is_the_noise_of_an_eval() -> None:
    spec = eval_spec(EvalResult("exact_answers", 90.0, 88.0, "min", 20, 1.0, "percent"))
    noise = NoiseRule()
    assert noise.verdict(spec, Spread.of([90, 80]), Spread.of([84, 86]), 0) == "same"
    assert noise.verdict(spec, Spread.of([90, 91]), Spread.of([70, 71]), 0) == "worse"
    typo = eval_spec(EvalResult("typo_rate", 0.0, 0.002, "max", 400, 1.0, "rate"))
    assert noise.verdict(typo, Spread.of([0.0, 0.0]), Spread.of([0.05, 0.05]), 0) == "worse"
