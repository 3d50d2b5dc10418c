"""The compare flow on the lab by checkpoint, quality and decode at depth (issue 26.2): side B
serves another checkpoint (a second tiny chat model in the lab hub) whose answers carry typos
(the stand-in's `typos` switch), both sides run their recipe's quality gate twice, and both are
benchmarked with the decode rate at a context depth. The artifact shows the checkpoint swap,
both sides' scores and depth figures, and the ship rule's verdict: B does not ship, for its
typo rate. Leaves nothing running."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from lab_flows import LAB_SINGLE_RECIPE, compare_artifact, nothing_runs, recipe_variant

from flows.compare import compare
from lab.cluster import Lab
from lab.models import publish_lab_models
from lab.tinymodel import generate_repo
from sparkdeploy.remote import ssh
from sparkdeploy.spec.recipe import RepoRef
from sparkdeploy.steps.benchmark import BenchmarkSettings
from sparkdeploy.steps.benchmark_depth import DEPTH_HEADROOM_TOKENS
from sparkdeploy.steps.compare import CompareSide, Comparison

pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("prefect_harness")]

OTHER_CHECKPOINT = "lab/tiny-chat-b"
SETTINGS = BenchmarkSettings(
    concurrency=[1],
    input_tokens=64,
    output_tokens=32,
    requests_per_level=8,
    repeats=3,
    decode_depths=[0, 8192],
)
SMOKE_OPTIONS = 'chat_template_kwargs = { reasoning_effort = "low" }\n'
EVALS = """
[quality.typo_rate]
max_typo_rate = 0.002
samples = 20

[quality.exact_answers]
min_score = 100
"""
DELAY = {"STANDIN_DECODE_DELAY_S": "0.004"}  # per streamed chunk: decode rates to compare
SHIP_IF = "typo_rate <= 0.002, exact_answers >= 100, decode@8192 not worse"


@pytest.fixture(scope="module")
def cluster(lab_cluster: Lab, lab_engine_image: str) -> Iterator[str]:
    """The lab's inventory, its hub holding the lab models and a second chat checkpoint."""
    publish_lab_models(lab_cluster.hub_repos_dir)
    generate_repo(lab_cluster.hub_repos_dir, OTHER_CHECKPOINT, num_shards=2, total_bytes=2 << 20)
    yield str(lab_cluster.inventory_path)
    ssh.close_cached()


@pytest.fixture(autouse=True)
def variants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARKDEPLOY_VARIANTS_DIR", str(tmp_path / "variants"))


def test_a_checkpoint_swap_judged_by_quality_and_decode_at_depth(
    cluster: str, tmp_path: Path
) -> None:
    gated = recipe_variant(
        tmp_path, "lab-gated", LAB_SINGLE_RECIPE, (SMOKE_OPTIONS, SMOKE_OPTIONS + EVALS)
    )
    state = compare(
        side_a=CompareSide(recipe=gated, env=DELAY),
        side_b=CompareSide(
            recipe=gated, model=OTHER_CHECKPOINT, env={**DELAY, "STANDIN_FAULT": "typos:0.05"}
        ),
        cluster=cluster,
        settings=SETTINGS,
        noise_floor=0.5,
        latency_floor_ms=10.0,
        ship_if=SHIP_IF,
        quality_repeats=2,
        return_state=True,
    )
    comparison: Comparison = state.result()
    markdown = compare_artifact(state.state_details.flow_run_id)
    print(markdown)
    assert comparison.failed == []  # a score past its threshold is a finding, not a failure
    assert comparison.prepared.b.checkpoint == RepoRef(repo=OTHER_CHECKPOINT)
    assert f"{OTHER_CHECKPOINT}@main" in markdown.split("## Side by side")[0]  # the diff on top

    typo = comparison.row("quality", "typo_rate (≤ 0.20 %)")
    assert typo.a.endswith("(2 runs), pass")
    assert "FAIL 2/2" in typo.b
    assert typo.verdict == "worse"
    exact = comparison.row("quality", "exact_answers (≥ 100.0 %)")
    assert exact.a.startswith("100.0 %")
    assert exact.b.startswith("100.0 %")
    assert exact.verdict == "same"

    # both sides measured decode at each depth, 8192 lowered to lab-single's max-model-len
    room = 4096 - SETTINGS.output_tokens - DEPTH_HEADROOM_TOKENS
    for side in (comparison.a, comparison.b):
        assert side.benchmark is not None
        depths = side.benchmark.depth_figures()
        assert depths[8192]["depth_context_tokens"].value == room
        for depth in (0, 8192):
            assert depths[depth]["depth_decode_tok_s"].value > 0
    for group in ("d=0", "d=8192", "c=1"):
        row = comparison.row(group, "errors")
        assert row.a == row.b == "0"
        assert row.verdict == "same"
    decode = comparison.row("d=8192", "decode tok/s (one request)")
    assert decode.a != "—"
    assert decode.b != "—"
    assert f"depth 8192 measured at {room}" in markdown

    ship = comparison.ship
    assert ship is not None
    assert not ship.ships
    met = {outcome.condition.text: outcome.met for outcome in ship.outcomes}
    assert met["typo_rate <= 0.002"] is False
    assert met["exact_answers >= 100"] is True
    assert met["decode@8192 not worse"] is not None  # judged, either way
    assert f"## Ship rule: DO NOT SHIP B ({SHIP_IF})" in markdown
    assert "- typo_rate <= 0.002: NOT met" in markdown
    nothing_runs(cluster)
