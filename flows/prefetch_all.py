"""The `prefetch-all` flow: every deployable recipe's repos into a cluster's NAS cache."""

from __future__ import annotations

from prefect import flow

from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.project import find_cluster
from sparkdeploy.steps.prefetch import RepoOutcome
from tasks.artifacts import artifacts_written
from tasks.catalog import repos_of_deployable_recipes
from tasks.prefetch import prefetch_repos


@flow(
    name="prefetch-all",
    flow_run_name="prefetch-all {recipes} into {cluster}",
    on_completion=[artifacts_written],
    on_failure=[artifacts_written],
)
def prefetch_all(
    cluster: str, recipes: str = "*", update_revisions: bool = False, rehash: bool = False
) -> list[RepoOutcome]:
    """Scheduled nightly: tomorrow's deploys then find their weights complete on the NAS.

    `recipes` is a glob on recipe names (e.g. "lab-*" for the lab, whose hub holds only the
    lab's models). An unpinned repo stays at the commit the NAS holds (update_revisions moves
    it to the hub's); rehash hashes every file of the NAS cache again."""
    inventory = load_cluster(find_cluster(cluster))
    outcomes: list[RepoOutcome] = []
    for (include, exclude), repos in repos_of_deployable_recipes(recipes).items():
        outcomes += prefetch_repos(
            repos,
            inventory.nas.hf_cache,
            inventory.hub.endpoint,
            allow_http_token=inventory.hub.allow_http_token,
            update_revisions=update_revisions,
            rehash=rehash,
            include=include,
            exclude=exclude,
        )
    return outcomes
