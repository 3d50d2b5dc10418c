"""The `preview` flow: what a deploy of a recipe would do now, per step and node, read without
changing anything; its markdown artifact `preview-<deployment id>`."""

from __future__ import annotations

from prefect import flow

from sparkdeploy.steps.preview import Preview
from tasks.artifacts import artifacts_written
from tasks.plan import plan_deployment
from tasks.preview import preview_deployment


@flow(
    name="preview",
    flow_run_name="preview {recipe} on {cluster}",
    on_completion=[artifacts_written],
    on_failure=[artifacts_written],
)
def preview(
    recipe: str,
    cluster: str,
    nodes: list[str] | None = None,
    allow_blocked: bool = False,
    replace: bool = False,
    update_revisions: bool = False,
    lock_timeout_s: float = 600.0,
) -> Preview:
    """What `deploy` with the same parameters would do now: per step and node adopt, copy,
    download, pull, ship, build, replace, wait or refuse, with the bytes and the time expected."""
    plan = plan_deployment(recipe, cluster, nodes, allow_blocked=allow_blocked)
    return preview_deployment(
        plan,
        cluster,
        replace=replace,
        update_revisions=update_revisions,
        lock_timeout_s=lock_timeout_s,
    )
