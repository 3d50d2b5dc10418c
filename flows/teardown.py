"""The `teardown` flow: a deployment's containers stopped and removed, logs kept, nodes freed."""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run

from sparkdeploy.errors import TeardownError
from sparkdeploy.steps.teardown import TeardownReport
from tasks.artifacts import artifacts_written
from tasks.runlabels import label_flow_run
from tasks.teardown import find_recipe_teardown, teardown_deployment, teardown_deployment_id


def _run_name() -> str:
    parameters = flow_run.get_parameters()
    what = parameters.get("deployment_id") or parameters.get("recipe")
    return f"teardown {what} on {parameters.get('cluster')}"


@flow(
    name="teardown",
    flow_run_name=_run_name,
    on_completion=[artifacts_written],
    on_failure=[artifacts_written],
)
def teardown(
    recipe: str | None = None,
    *,
    cluster: str,
    nodes: list[str] | None = None,
    deployment_id: str | None = None,
) -> list[TeardownReport]:
    """Tear down what `deploy` started for this recipe on these nodes, or the deployment
    `deployment_id` (as status and a deploy's summary name it) wherever it is on the cluster.
    Idempotent.

    A recipe is not trusted to say what runs: when it can no longer be planned (deleted,
    broken) or plans another deployment than the one of it that runs (changed required_nodes),
    what runs of it is torn down by deployment id, as its containers' labels and the node lock
    records name it, and the run's log says so. One report per deployment torn down (none when
    nothing of the recipe is left).
    """
    if deployment_id is not None:
        if recipe is not None:
            raise TeardownError(
                f"give the teardown recipe {recipe} or deployment_id {deployment_id}, not both"
            )
        return [teardown_deployment_id(deployment_id, cluster)]
    if recipe is None:
        raise TeardownError(
            "give the teardown a recipe (as the deploy was given it) or a deployment_id (as"
            " `sparkdeploy status` shows it)"
        )
    plan, orphans = find_recipe_teardown(recipe, cluster, nodes)
    if plan is not None:
        label_flow_run(plan, verb="teardown")
        return [teardown_deployment(plan)]
    return [teardown_deployment_id(orphan, cluster) for orphan in orphans]
