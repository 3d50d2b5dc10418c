"""Prefect task: the serving benchmark of a running deployment (logic in
sparkdeploy.steps.benchmark).

The target is what the smoke test talks to (endpoint, served name, API key, the recipe's
chat_template_kwargs); the sweep's levels are bounded by the head's --max-num-seqs. Every
request's figures go to the NAS beside the deployment's logs; a table and a chart go to the
run's artifacts. No retries: a second sweep would measure another moment.
"""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.benchmark import BenchmarkResult, BenchmarkSettings, run_benchmark, save_raw
from sparkdeploy.steps.smoke_test import SmokeSettings
from sparkdeploy.vllm.args import argv_flag_value
from tasks.artifacts import publish_markdown, publish_table
from tasks.common import artifact_key

MAX_NUM_SEQS_FLAG = "--max-num-seqs"


@task(name="benchmark", retries=0)
def benchmark_deployment(
    plan: Plan, settings: BenchmarkSettings, label: str | None = None
) -> BenchmarkResult:
    """The sweep against the deployment's endpoint; the raw results' path is in the chart's
    artifact and the log."""
    logger = get_run_logger()
    max_num_seqs = argv_flag_value(plan.head_serve_argv, MAX_NUM_SEQS_FLAG)
    result = run_benchmark(
        SmokeSettings.for_plan(plan),
        settings,
        max_num_seqs=int(max_num_seqs) if max_num_seqs is not None else None,
        label=label or plan.recipe,
        progress=logger.info,
    )
    raw = save_raw(result, plan.runs_dir, plan.deployment_id)
    logger.info("every request's figures: %s", raw)
    check = result.client_check
    (logger.warning if check.client_bound else logger.info)("%s", check.text())
    for note in result.engine_disagreements():
        logger.warning("%s", note)
    levels = ", ".join(str(level.concurrency) for level in result.levels)
    publish_table(
        key=artifact_key("benchmark", plan.deployment_id),
        table=result.table_rows(),
        description=(
            f"Benchmark of {plan.recipe} ({plan.served_model_name} at {plan.endpoint}) at "
            f"concurrency {levels}: median ± half the range of {settings.repeats} runs"
        ),
    )
    publish_markdown(
        key=artifact_key("benchmark-chart", plan.deployment_id),
        markdown=result.markdown(str(raw)),
        description=f"Throughput and latency of {plan.recipe} against concurrency",
    )
    return result
