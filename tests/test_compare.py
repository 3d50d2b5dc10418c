"""The compare's logic without Prefect or a lab: sides prepared (variants written and checked),
placement, verdicts within noise, a failed side, the artifact's markdown."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from sparkdeploy.errors import BootFailed, CompareError, ContainerStartError
from sparkdeploy.report.benchmark_figures import FIGURE_BY_NAME, Spread
from sparkdeploy.report.verdicts import NoiseRule, judge
from sparkdeploy.spec.cluster import Cluster, load_cluster
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.spec.recipe_variant import write_variant
from sparkdeploy.steps.benchmark import BenchmarkResult, LevelResult, LevelRun
from sparkdeploy.steps.benchmark_requests import PromptSize, RequestSample
from sparkdeploy.steps.compare import (
    CompareSide,
    Comparison,
    PreparedComparison,
    place_sides,
    prepare,
)
from sparkdeploy.steps.compare_outcome import SideOutcome, failure_cause
from sparkdeploy.steps.smoke_test import SmokeCheck, SmokeReport
from sparkdeploy.steps.summary import DeploySummary

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "clusters" / "dgx-spark-4.toml"
REAL_1X = ROOT / "recipes" / "real-lab-1x" / "recipe.toml"


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return load_cluster(EXAMPLE)


def test_placement_at_once_when_the_cluster_has_room_else_one_after_the_other(
    cluster: Cluster,
) -> None:
    assert place_sides(cluster, (1, 2), (None, None), "auto") == (
        ["dgx1"],
        ["dgx2", "dgx3"],
        True,
        "at once on disjoint nodes",
    )
    a, b, at_once, how = place_sides(cluster, (4, 1), (None, None), "auto")
    assert (a, b, at_once) == (["dgx1", "dgx2", "dgx3", "dgx4"], ["dgx1"], False)
    assert how == "one after the other (A torn down before B deploys)"
    assert place_sides(cluster, (1, 1), (None, None), "sequential")[:3] == (
        ["dgx1"],
        ["dgx1"],
        False,
    )
    # a side's own nodes are kept; the other side takes the first free ones
    assert place_sides(cluster, (1, 1), (["dgx1"], None), "auto")[:3] == (["dgx1"], ["dgx2"], True)
    with pytest.raises(CompareError, match="need 4 \\+ 1 nodes, the cluster has 4"):
        place_sides(cluster, (4, 1), (None, None), "at_once")
    with pytest.raises(CompareError, match="and share dgx2; name disjoint nodes"):
        place_sides(cluster, (2, 1), (["dgx1", "dgx2"], ["dgx2"]), "at_once")


def test_prepare_writes_a_checked_variant_and_puts_the_diff_on_top(
    cluster: Cluster, tmp_path: Path
) -> None:
    prepared = prepare(
        CompareSide(recipe="real-lab-1x"),
        CompareSide(recipe="real-lab-1x", args=["--max-num-seqs", "4"], drop_args=["--dtype"]),
        cluster,
        "auto",
        variants=tmp_path,
        root=ROOT,
    )
    assert prepared.at_once
    assert (prepared.a.nodes, prepared.b.nodes) == (["dgx1"], ["dgx2"])
    assert prepared.a.recipe == "real-lab-1x"
    variant = Path(prepared.b.recipe)
    assert variant.parent == tmp_path
    assert prepared.b.recipe_id == variant.name
    assert variant.name.startswith("real-lab-1x.")
    assert len(variant.name) == len("real-lab-1x.") + 8
    assert prepared.b.description == "real-lab-1x with args --max-num-seqs 4; without --dtype"
    assert prepared.a.deployment_id != prepared.b.deployment_id
    changed = {(d.section, d.key): (d.a, d.b) for d in prepared.diff.differences}
    assert changed == {
        ("args", "--max-num-seqs"): ("8", "4"),
        ("args", "--dtype"): ("float32", "(not set)"),
    }


def test_a_variant_is_written_once_privately_and_keeps_the_recipe(tmp_path: Path) -> None:
    recipe = load_recipe(REAL_1X)
    first = write_variant(recipe, tmp_path, env={"HF_TOKEN": "hf_secret123"})
    stat = first.stat()
    assert oct(stat.st_mode & 0o777) == "0o600"
    assert "hf_secret123" not in first.read_text().splitlines()[0]  # the header shows ***
    assert write_variant(recipe, tmp_path, env={"HF_TOKEN": "hf_secret123"}) == first
    assert first.stat().st_mtime_ns == stat.st_mtime_ns  # same text: not written again
    variant = load_recipe(first)
    assert variant.env["HF_TOKEN"] == "hf_secret123"
    assert variant.args == recipe.args
    assert variant.extra_mounts == recipe.extra_mounts
    assert variant.shm_size == recipe.shm_size
    toggled = load_recipe(
        write_variant(recipe, tmp_path, args=["--no-enforce-eager", "--max_num_seqs=2"])
    )
    assert toggled.vllm_args.value("--max-num-seqs") == "2"
    canonical = [flag.canonical for flag in toggled.vllm_args.flags]
    assert canonical.count("--max-num-seqs") == 1  # the override replaced the recipe's
    assert "--no-enforce-eager" in toggled.args


def git(repo: Path, *argv: str) -> str:
    completed = subprocess.run(
        ["git", "-C", str(repo), *argv], capture_output=True, text=True, check=True
    )
    return completed.stdout.strip()


@pytest.fixture
def project_history(tmp_path: Path) -> tuple[Path, str]:
    """A project checkout whose recipe real-lab-1x was changed after the commit returned."""
    project = tmp_path / "project"
    recipe = project / "recipes" / "real-lab-1x" / "recipe.toml"
    recipe.parent.mkdir(parents=True)
    recipe.write_text(REAL_1X.read_text())
    git(project, "init", "-q")
    for key, value in (("user.name", "t"), ("user.email", "t@example.invalid")):
        git(project, "config", key, value)
    git(project, "add", ".")
    git(project, "commit", "-qm", "recipe")
    before = git(project, "rev-parse", "HEAD")
    git(project, "tag", "before-change")
    recipe.write_text(recipe.read_text().replace('"--max-num-seqs", "8"', '"--max-num-seqs", "6"'))
    git(project, "commit", "-qam", "fewer sequences")
    return project, before


def test_a_side_can_be_the_recipe_at_a_git_revision(
    cluster: Cluster, tmp_path: Path, project_history: tuple[Path, str]
) -> None:
    project, before = project_history
    prepared = prepare(
        CompareSide(recipe="real-lab-1x", revision="before-change"),
        CompareSide(recipe="real-lab-1x"),
        cluster,
        "sequential",
        variants=tmp_path / "variants",
        root=project,
    )
    written = Path(prepared.a.recipe) / "recipe.toml"
    assert written.parent.name == f"real-lab-1x.{before[:8]}" == prepared.a.recipe_id
    assert oct(written.stat().st_mode & 0o777) == "0o600"
    assert written.read_text().endswith(REAL_1X.read_text())  # verbatim, comments too
    assert prepared.a.description == "real-lab-1x at before-change"
    assert prepared.a.deployment_id != prepared.b.deployment_id
    changed = {(d.section, d.key): (d.a, d.b) for d in prepared.diff.differences}
    assert changed == {("args", "--max-num-seqs"): ("8", "6")}
    with_override = prepare(
        CompareSide(recipe="real-lab-1x", revision=before[:10], args=["--max-num-seqs", "2"]),
        CompareSide(recipe="real-lab-1x"),
        cluster,
        "sequential",
        variants=tmp_path / "variants",
        root=project,
    )
    assert (
        load_recipe(Path(with_override.a.recipe) / "recipe.toml").vllm_args.value("--max-num-seqs")
        == "2"
    )


@pytest.mark.parametrize(
    ("revision", "problem"),
    [
        ("no-such-tag", "'no-such-tag' is not a commit, tag or branch of the project's git"),
        ("--output=/tmp/x", "'--output=/tmp/x' is not a commit, tag or branch"),
        ("HEAD~1:recipes", "'HEAD~1:recipes' is not a commit, tag or branch"),
    ],
)
def test_a_revision_that_is_no_commit_is_named(
    cluster: Cluster, tmp_path: Path, project_history: tuple[Path, str], revision: str, problem: str
) -> None:
    project, _ = project_history
    with pytest.raises(CompareError, match=re.escape(f"side A: {problem}")):
        prepare(
            CompareSide(recipe="real-lab-1x", revision=revision),
            CompareSide(recipe="real-lab-1x"),
            cluster,
            "sequential",
            variants=tmp_path / "variants",
            root=project,
        )
    assert not (tmp_path / "variants").exists()


def test_a_revision_without_the_recipe_is_named(
    cluster: Cluster, tmp_path: Path, project_history: tuple[Path, str]
) -> None:
    project, _ = project_history
    other = project / "recipes" / "newer" / "recipe.toml"
    other.parent.mkdir()
    other.write_text(REAL_1X.read_text())
    git(project, "add", ".")
    git(project, "commit", "-qm", "newer")
    with pytest.raises(
        CompareError,
        match=r"side B: recipes/newer/recipe.toml does not exist at "
        r"before-change .*git log --oneline -- recipes/newer/recipe.toml",
    ):
        prepare(
            CompareSide(recipe="newer"),
            CompareSide(recipe="newer", revision="before-change"),
            cluster,
            "sequential",
            variants=tmp_path / "variants",
            root=project,
        )


def test_overrides_a_recipe_cannot_take_are_named(tmp_path: Path) -> None:
    recipe = load_recipe(REAL_1X)
    with pytest.raises(CompareError, match="side B drop_args: --enforce-eager not in recipe"):
        write_variant(recipe, tmp_path, drop_args=["--enforce-eager"], what="side B")
    with pytest.raises(CompareError, match="--tensor-parallel-size is set by the plan"):
        write_variant(recipe, tmp_path, args=["--tensor-parallel-size", "2"], what="side B")
    with pytest.raises(CompareError, match=r"side A args\[2\]: stray value .b."):
        write_variant(recipe, tmp_path, args=["--dtype", "a", "b"], what="side A")


def test_verdicts_allow_for_the_spread_and_the_floor() -> None:
    assert judge(0.05, 0.1, "higher") == "same"
    assert judge(-0.5, 0.1, "higher") == "worse"
    assert judge(-0.5, 0.1, "lower") == "better"
    assert judge(1.0, 0.1, None) == "—"


def test_figures_are_compared_as_ratios_within_both_spreads() -> None:
    noise = NoiseRule()
    output = FIGURE_BY_NAME["output_tok_s"]
    # one side's runs spread 2.7x on a busy host, the other's 8x lower: worse all the same
    assert noise.verdict(output, Spread.of([677, 1245, 1813]), Spread.of([148, 152, 156]), 16) == (
        "worse"
    )
    # a ratio inside both sides' spreads is the same, however large the spreads
    assert noise.verdict(output, Spread.of([100, 150, 200]), Spread.of([130, 180, 190]), 16) == (
        "same"
    )
    assert noise.verdict(output, Spread.of([100, 100, 100]), Spread.of([109, 109, 109]), 16) == (
        "same"  # within the 10 % floor
    )
    errors = FIGURE_BY_NAME["errors"]
    assert noise.verdict(errors, Spread.of([0, 0, 0]), Spread.of([0, 0, 0]), 16) == "same"
    assert noise.verdict(errors, Spread.of([0, 0, 0]), Spread.of([2, 3, 2]), 16) == "worse"
    ttft = FIGURE_BY_NAME["ttft_p50_s"]
    assert noise.verdict(ttft, Spread.of([0.001] * 3), Spread.of([0.0025] * 3), 16) == "same"
    p99 = FIGURE_BY_NAME["ttft_p99_s"]
    # a p99 of 32 requests is their slowest: shown, not judged; of 400, judged
    assert noise.verdict(p99, Spread.of([0.1] * 3), Spread.of([0.5] * 3), 32) == "—"
    assert noise.verdict(p99, Spread.of([0.1] * 3), Spread.of([0.5] * 3), 400) == "worse"


def sample(itl_s: float, ttft_s: float = 0.01, tokens: int = 16) -> RequestSample:
    return RequestSample(
        started_s=0.0,
        ttft_s=ttft_s,
        e2e_s=ttft_s + itl_s * (tokens - 1),
        itl_s=(itl_s,) * (tokens - 1),
        prompt_tokens=64,
        output_tokens=tokens,
        client_cpu_s=0.001,
    )


def benchmark(itl_by_run: list[float], concurrency: int = 4) -> BenchmarkResult:
    runs = tuple(
        LevelRun(
            concurrency,
            repeat,
            wall_s=itl * 16 * 2,
            samples=tuple(sample(itl) for _ in range(8)),
            engine=None,
        )
        for repeat, itl in enumerate(itl_by_run)
    )
    return BenchmarkResult(
        base_url="http://x",
        served_model_name="m",
        settings={},
        prompt=PromptSize(64, 58, 64),
        levels=(LevelResult(concurrency, runs),),
        lowered=None,
        started_at="2025-01-01T00:00:00Z",
    )


def summary(ready_after_s: float) -> DeploySummary:
    return DeploySummary(
        deployment_id="d-00000000",
        recipe="r",
        cluster="c",
        endpoint="http://x",
        served_model_name="m",
        nodes=[],
        step_seconds={"boot": 2.0, "readiness-gate": ready_after_s},
        ready_after_s=ready_after_s,
        head_markers_s={"weights_loaded": 0.5},
        head_figures={"kv_cache_tokens": 100_000.0, "weights_load_s": 0.4},
    )


def smoke(*, garbled: bool = False) -> SmokeReport:
    return SmokeReport(
        "http://x",
        "m",
        [
            SmokeCheck("canary_multiply", True, "answered '5461'"),
            SmokeCheck("no_garbled_text", not garbled, "garbled" if garbled else "none found"),
        ],
    )


@pytest.fixture
def prepared(cluster: Cluster, tmp_path: Path) -> PreparedComparison:
    return prepare(
        CompareSide(recipe="real-lab-1x"),
        CompareSide(recipe="real-lab-1x", env={"STANDIN_DECODE_DELAY_S": "0.02"}),
        cluster,
        "sequential",
        variants=tmp_path,
        root=ROOT,
    )


def test_a_slower_side_is_worse_on_decode_and_the_same_on_correctness(
    prepared: PreparedComparison,
) -> None:
    a = SideOutcome("A", summary(10.0), smoke(), benchmark([0.010, 0.011, 0.0105]))
    b = SideOutcome("B", summary(10.5), smoke(), benchmark([0.040, 0.041, 0.039]))
    comparison = Comparison.of(prepared, a, b, NoiseRule())
    assert comparison.row("c=4", "decode tok/s per request (p50)").verdict == "worse"
    assert comparison.row("c=4", "ITL p50 (ms)").verdict == "worse"
    assert comparison.row("c=4", "output tok/s").verdict == "worse"
    assert comparison.row("c=4", "errors").verdict == "same"
    assert comparison.row("smoke", "canary_multiply").verdict == "same"
    assert comparison.row("boot", "ready after (s)").verdict == "same"  # 5 % of one boot
    assert comparison.row("log", "KV cache (tokens)").verdict == "same"
    assert comparison.row("run", "outcome").verdict == "same"
    decode = comparison.row("c=4", "decode tok/s per request (p50)")
    assert decode.a.startswith("95.2 ± ")
    assert decode.difference.startswith("−")
    assert decode.difference.endswith("(-74%)")


def test_overlapping_spreads_are_the_same(prepared: PreparedComparison) -> None:
    a = SideOutcome("A", summary(10.0), smoke(), benchmark([0.010, 0.013, 0.011]))
    b = SideOutcome("B", summary(12.0), smoke(), benchmark([0.012, 0.010, 0.0115]))
    comparison = Comparison.of(prepared, a, b, NoiseRule())
    judged = {row.verdict for row in comparison.rows if row.verdict != "—"}
    assert judged == {"same"}, [row for row in comparison.rows if row.verdict != "same"]


def test_a_failed_side_is_named_and_the_other_is_still_shown(
    prepared: PreparedComparison,
) -> None:
    error = BootFailed(
        "boot failed",
        node="dgx1",
        kind="engine_core_init_failed",
        cause="RuntimeError: x",
        excerpt=[],
    )
    a = SideOutcome("A", summary(10.0), smoke(), benchmark([0.01, 0.01, 0.01]))
    b = SideOutcome("B", failed_at="deploy", cause=failure_cause(error))
    comparison = Comparison.of(prepared, a, b, NoiseRule())
    assert comparison.failed == [b]
    assert comparison.row("run", "outcome").verdict == "worse"
    output = comparison.row("c=4", "output tok/s")
    assert output.b == "—"
    assert output.verdict == "—"
    assert output.a != "—"
    markdown = comparison.markdown({"A": "http://ui/runs/flow-run/1"})
    assert "FAILED at deploy: engine_core_init_failed: RuntimeError: x (on dgx1)" in markdown
    assert "[side A](http://ui/runs/flow-run/1)" in markdown
    assert "data:image/svg+xml;base64," in markdown  # A's curves alone
    preflight = ContainerStartError(
        "deployment d: preflight failed:\nnode dgx1: 14 GiB free of 23 GiB"
    )
    assert failure_cause(preflight) == (
        "ContainerStartError: deployment d: preflight failed: node dgx1: 14 GiB free of 23 GiB"
    )
    smoke_failed = SideOutcome("B", summary(10.0), smoke(garbled=True), failed_at="smoke")
    assert (
        Comparison.of(prepared, a, smoke_failed, NoiseRule())
        .row("smoke", "no_garbled_text")
        .verdict
        == "worse"
    )


def test_the_artifact_has_the_diff_on_top_then_the_table(prepared: PreparedComparison) -> None:
    a = SideOutcome("A", summary(10.0), smoke(), benchmark([0.010, 0.011, 0.0105]))
    b = SideOutcome("B", summary(10.5), smoke(), benchmark([0.040, 0.041, 0.039]))
    markdown = Comparison.of(prepared, a, b, NoiseRule()).markdown()
    diff_at = markdown.index("## What differs")
    assert "| env | `STANDIN_DECODE_DELAY_S` | (not set) | 0.02 |" in markdown
    assert diff_at < markdown.index("| env |") < markdown.index("## Side by side")
    assert "| c=4 | decode tok/s per request (p50) |" in markdown
    assert "**worse**" in markdown
    assert "Noise: benchmark figures: median of the repeated runs" in markdown
