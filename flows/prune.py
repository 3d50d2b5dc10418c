"""The `prune` flow: what deployments left on a cluster's nodes and what no recipe reads on its
NAS, listed (a dry run, by default) or removed; a `prune-<cluster>` table artifact."""

from __future__ import annotations

from prefect import flow
from pydantic import Field

from sparkdeploy.steps.prune import DEFAULT_MIN_AGE_HOURS
from sparkdeploy.steps.prune.rows import PruneRow
from tasks.artifacts import artifacts_written
from tasks.prune import prune_cluster


@flow(
    name="prune",
    flow_run_name="prune {cluster}",
    on_completion=[artifacts_written],
    on_failure=[artifacts_written],
)
def prune(
    cluster: str,
    dry_run: bool = Field(
        default=True, description="List what would go, with its bytes; remove nothing."
    ),
    min_age_hours: float = Field(
        default=DEFAULT_MIN_AGE_HOURS,
        description=(
            "Nothing changed more recently than this goes (default a week): composed dirs,"
            " local files, NAS revisions. Partial downloads go after a day."
        ),
        ge=0,
    ),
) -> list[PruneRow]:
    """Scheduled nightly as a dry run: its artifact lists what a run with dry_run=false would
    free. Never removed: what a running or held deployment uses, what a recipe names, a local
    file another lane links, anything newer than min_age_hours."""
    return prune_cluster(cluster, dry_run=dry_run, min_age_hours=min_age_hours)
