"""The `teardown` flow: a deployment's containers stopped and removed, logs kept, nodes freed."""

from __future__ import annotations

from prefect import flow

from sparkdeploy.steps.teardown import TeardownReport
from tasks.artifacts import artifacts_written
from tasks.plan import plan_deployment
from tasks.runlabels import label_flow_run
from tasks.teardown import teardown_deployment


@flow(
    name="teardown",
    flow_run_name="teardown {recipe} on {cluster}",
    on_completion=[artifacts_written],
    on_failure=[artifacts_written],
)
def teardown(recipe: str, cluster: str, nodes: list[str] | None = None) -> TeardownReport:
    """Tear down what `deploy` started for this recipe on these nodes. Idempotent."""
    plan = plan_deployment(recipe, cluster, nodes, allow_blocked=True)
    label_flow_run(plan, verb="teardown")
    return teardown_deployment(plan)
