"""The deploy's summary artifact (sparkdeploy.steps.summary): each step's wall time in the order the
steps ran, the plan's nodes, the head's boot markers, the fit figures and a curl that works."""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path

import pytest

from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.memory import FitReport, NodeFit
from sparkdeploy.spec.plan import Plan, make_plan
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.steps.readiness_gate import TimelineEntry
from sparkdeploy.steps.smoke_test import CANARIES
from sparkdeploy.steps.summary import DeploySummary, NodeRow, StepClock

ROOT = Path(__file__).parent.parent
PAIR = ROOT / "recipes" / "lab-pair" / "recipe.toml"
EXAMPLE = ROOT / "clusters" / "dgx-spark-4.toml"
GIB = 1 << 30
NODE_HEADER = "| node | rank | role | container | host |"
STEPS = {"stage-engram, image, compose-model": 12.34, "boot": 3.0, "readiness-gate": 95.06}


@pytest.fixture
def plan() -> Plan:
    """lab-pair on dgx4 (the head) and dgx2, named out of inventory order."""
    return make_plan(load_recipe(PAIR), load_cluster(EXAMPLE), ["dgx4", "dgx2"])


def fit_report() -> FitReport:
    node = NodeFit(
        node="dgx4",
        ranks=[0],
        weights_bytes=3 * GIB,
        overhead_bytes=4 * GIB,
        kv_bytes_per_token=64 * 1024,
        kv_request_bytes=GIB // 4,
        kv_requests_bytes=None,
        kv_cache_bytes=50 * GIB,
        budget_bytes=109 * GIB,
        headroom_bytes=49 * GIB,
        kv_tokens=819_200,
        verdict="fits",
    )
    return FitReport(
        model="lab/tiny-chat",
        max_model_len=4096,
        max_num_seqs=None,
        kv_cache_dtype="auto",
        gpu_memory_utilization=0.9,
        kv_cache_memory_source=None,
        nodes=[node],
        notes=[],
        warnings=[],
        refusal=None,
    )


def entry(marker: str, node: str, seconds: float) -> TimelineEntry:
    return TimelineEntry(marker=marker, node=node, seconds=seconds, figures={}, line="...")


def curl_payload(markdown: str) -> tuple[list[str], dict[str, object]]:
    (command,) = [line for line in markdown.splitlines() if line.startswith("curl ")]
    argv = shlex.split(command)
    return argv, json.loads(argv[argv.index("-d") + 1])


def test_the_clock_keeps_each_steps_wall_time_in_the_order_they_ran() -> None:
    clock = StepClock()
    with clock.step("prefetch"):
        time.sleep(0.02)
    with clock.step("boot"):
        pass
    durations = clock.durations()
    assert list(durations) == ["prefetch", "boot"]
    assert 0.02 <= durations["prefetch"] < 2.0
    assert 0.0 <= durations["boot"] < 1.0


def test_a_step_that_fails_is_timed_too_and_its_error_goes_on() -> None:
    clock = StepClock()

    def failing_boot() -> None:
        with clock.step("boot"):
            time.sleep(0.01)
            raise RuntimeError("boot failed")

    with pytest.raises(RuntimeError, match="boot failed"):
        failing_boot()
    assert clock.durations()["boot"] >= 0.01


def test_the_clocks_durations_are_a_copy() -> None:
    clock = StepClock()
    with clock.step("boot"):
        pass
    clock.durations()["boot"] = 99.0
    clock.durations().clear()
    assert list(clock.durations()) == ["boot"]
    assert clock.durations()["boot"] < 99.0


def test_a_summary_of_a_plan_has_its_nodes_in_rank_order(plan: Plan) -> None:
    summary = DeploySummary.of(plan, STEPS, ready_after_s=95.0)
    assert (summary.recipe, summary.cluster, summary.served_model_name) == (
        "lab-pair",
        "dgx-spark-4",
        "tiny-chat",
    )
    assert summary.deployment_id == plan.deployment_id
    assert summary.endpoint == plan.endpoint == "http://192.168.100.14:8000"
    assert summary.nodes == [
        NodeRow(
            node="dgx4",
            rank=0,
            role="head",
            container=f"sparkdeploy-{plan.deployment_id}-dgx4",
            host="dgx4.lan",
        ),
        NodeRow(
            node="dgx2",
            rank=1,
            role="worker",
            container=f"sparkdeploy-{plan.deployment_id}-dgx2",
            host="dgx2.lan",
        ),
    ]


def test_only_the_heads_boot_markers_are_kept(plan: Plan) -> None:
    timeline = [
        entry("weights_loaded", "dgx4", 31.5),
        entry("weights_loaded", "dgx2", 30.0),
        entry("kv_cache_sized", "dgx4", 60.0),
        entry("nccl_ready", "dgx2", 20.0),
        entry("api_ready", "dgx4", 95.0),
    ]
    summary = DeploySummary.of(plan, STEPS, ready_after_s=95.0, timeline=timeline)
    assert summary.head_markers_s == {
        "weights_loaded": 31.5,
        "kv_cache_sized": 60.0,
        "api_ready": 95.0,
    }


def test_the_summary_keeps_its_own_copy_of_the_heads_figures(plan: Plan) -> None:
    figures = {"kv_cache_tokens": 819_200.0, "max_concurrency": 200.0}
    summary = DeploySummary.of(plan, STEPS, ready_after_s=1.0, head_figures=figures)
    figures["kv_cache_tokens"] = 0.0
    assert summary.head_figures == {"kv_cache_tokens": 819_200.0, "max_concurrency": 200.0}
    assert DeploySummary.of(plan, STEPS, ready_after_s=1.0).head_figures == {}


def test_the_markdown_names_the_deployment_its_nodes_and_every_steps_time(plan: Plan) -> None:
    markdown = DeploySummary.of(plan, STEPS, ready_after_s=95.04).markdown()
    lines = markdown.splitlines()
    assert lines[0] == "# lab-pair on dgx-spark-4"
    assert (
        f"Endpoint **http://192.168.100.14:8000**, served model `tiny-chat`, "
        f"deployment `{plan.deployment_id}`." in lines
    )
    node_rows = [line for line in lines if line.startswith("| dgx")]
    assert node_rows == [
        f"| dgx4 | 0 | head | `sparkdeploy-{plan.deployment_id}-dgx4` | dgx4.lan |",
        f"| dgx2 | 1 | worker | `sparkdeploy-{plan.deployment_id}-dgx2` | dgx2.lan |",
    ]
    step_rows = lines[lines.index("| step | seconds |") + 2 :][: len(STEPS)]
    assert step_rows == [
        "| stage-engram, image, compose-model | 12.3 |",
        "| boot | 3.0 |",
        "| readiness-gate | 95.1 |",
    ]
    assert "The engine was ready 95.0 s after the gate began." in lines


def test_the_markdown_tables_have_as_many_cells_a_row_as_their_header(plan: Plan) -> None:
    timeline = [entry("api_ready", "dgx4", 95.0)]
    markdown = DeploySummary.of(plan, STEPS, ready_after_s=95.0, timeline=timeline).markdown()
    tables = re.split(r"\n\n", markdown)
    for block in tables:
        rows = [line for line in block.splitlines() if line.startswith("|")]
        if rows:
            widths = {line.count("|") for line in rows}
            assert len(widths) == 1, block


def test_the_heads_boot_markers_are_listed_with_their_times(plan: Plan) -> None:
    timeline = [entry("weights_loaded", "dgx4", 31.46), entry("api_ready", "dgx4", 95.0)]
    markdown = DeploySummary.of(plan, STEPS, ready_after_s=95.0, timeline=timeline).markdown()
    lines = markdown.splitlines()
    at = lines.index("| head's boot marker | seconds |")
    assert lines[at + 2 : at + 4] == ["| weights_loaded | 31.5 |", "| api_ready | 95.0 |"]


def test_without_a_ready_time_markers_or_fit_those_parts_are_left_out(plan: Plan) -> None:
    markdown = DeploySummary.of(plan, {}, ready_after_s=None).markdown()
    assert "was ready" not in markdown
    assert "boot marker" not in markdown
    assert "Memory fit" not in markdown
    assert "| step | seconds |\n|---|---|\n\nTry it:" in markdown


def test_the_fit_figures_are_in_the_markdown_when_the_plan_has_them(plan: Plan) -> None:
    fitted = plan.model_copy(update={"fit": fit_report()})
    summary = DeploySummary.of(fitted, STEPS, ready_after_s=95.0)
    assert summary.fit == fit_report()
    markdown = summary.markdown()
    assert fit_report().markdown() in markdown
    assert "| dgx4 | 3.0 GiB | 4.0 GiB | 50.0 GiB | 256.0 MiB | 109.0 GiB | 49.0 GiB | " in markdown
    assert "819,200" in markdown


def test_a_note_is_shown_under_the_endpoint(plan: Plan) -> None:
    note = "Already serving: the running copy matches the plan; nothing was restarted."
    lines = DeploySummary.of(plan, {}, ready_after_s=None, note=note).markdown().splitlines()
    assert lines[lines.index(note) - 2].startswith("Endpoint **")
    assert lines[lines.index(note) + 2] == NODE_HEADER
    plain = DeploySummary.of(plan, {}, ready_after_s=None).markdown().splitlines()
    assert plain[2].startswith("Endpoint **")
    assert plain[3:5] == ["", NODE_HEADER]


def test_the_try_it_command_posts_valid_json_with_the_model_and_a_canary(plan: Plan) -> None:
    markdown = DeploySummary.of(plan, STEPS, ready_after_s=95.0).markdown()
    argv, payload = curl_payload(markdown)
    assert argv[:2] == ["curl", "http://192.168.100.14:8000/v1/chat/completions"]
    assert argv[argv.index("-H") + 1] == "Content-Type: application/json"
    assert payload == {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": CANARIES[0].prompt}],
    }
    assert markdown.endswith("```")


def test_the_try_it_command_quotes_a_model_name_with_quotes(plan: Plan) -> None:
    odd = plan.model_copy(update={"served_model_name": """it's "tiny" chat"""})
    _, payload = curl_payload(DeploySummary.of(odd, STEPS, ready_after_s=95.0).markdown())
    assert payload["model"] == """it's "tiny" chat"""


def test_a_summary_survives_a_json_round_trip(plan: Plan) -> None:
    # Prefect stores the flow's return value: the summary must come back whole.
    fitted = plan.model_copy(update={"fit": fit_report()})
    summary = DeploySummary.of(
        fitted,
        STEPS,
        ready_after_s=95.0,
        timeline=[entry("api_ready", "dgx4", 95.0)],
        head_figures={"kv_cache_tokens": 819_200.0},
        note="n",
    )
    again = DeploySummary.model_validate_json(summary.model_dump_json())
    assert again == summary
    assert again.markdown() == summary.markdown()
