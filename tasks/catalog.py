"""Prefect task: which repos the project's recipes need (logic in sparkdeploy.model.recipe)."""

from __future__ import annotations

import fnmatch

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.model.project import project_root
from sparkdeploy.model.recipe import RepoRef, load_all_recipes


@task(name="catalog")
def repos_of_deployable_recipes(pattern: str = "*") -> list[RepoRef]:
    """Every repo named by a recipe matching `pattern` (a glob on recipe names) that is not
    blocked, each once, in recipe order."""
    logger = get_run_logger()
    repos: list[RepoRef] = []
    for name, recipe in load_all_recipes(project_root() / "recipes").items():
        if not fnmatch.fnmatchcase(name, pattern):
            continue
        if recipe.blocked_reason is not None:
            logger.info("skipping blocked recipe %s: %s", name, recipe.blocked_reason)
            continue
        repos += [repo for repo in recipe.hf_repos if repo not in repos]
    logger.info("%d repos: %s", len(repos), ", ".join(repo.repo for repo in repos))
    return repos
