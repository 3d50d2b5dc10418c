"""The `benchmark` flow: a running deployment measured at a sweep of concurrencies."""

from __future__ import annotations

from prefect import flow
from pydantic import Field

from sparkdeploy.steps.benchmark import DEFAULT_SETTINGS, BenchmarkResult, BenchmarkSettings
from tasks.artifacts import artifacts_written
from tasks.benchmark import benchmark_deployment
from tasks.plan import plan_deployment
from tasks.runlabels import label_flow_run


@flow(
    name="benchmark",
    flow_run_name="benchmark {recipe} on {cluster}",
    on_completion=[artifacts_written],
    on_failure=[artifacts_written],
)
def benchmark(
    recipe: str = Field(description="The deployed recipe: a name under recipes/ or a path."),
    cluster: str = Field(description="The cluster it runs on (clusters/<name>.toml)."),
    nodes: list[str] | None = Field(
        default=None,
        description="Its nodes in rank order, as it was deployed (default: the recipe's first "
        "required_nodes nodes).",
    ),
    settings: BenchmarkSettings = Field(
        default=DEFAULT_SETTINGS,
        description="Concurrency levels, prompt and output lengths, requests and repeats.",
    ),
) -> BenchmarkResult:
    """Streaming chat requests against the deployment of `recipe` on `nodes`; a table and a
    chart as artifacts, every request's figures on the NAS beside the deployment's logs."""
    plan = plan_deployment(recipe, cluster, nodes, allow_blocked=True)
    label_flow_run(plan, verb="benchmark")
    return benchmark_deployment(plan, settings)
