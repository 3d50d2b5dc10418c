"""Prefect task: which repos the project's recipes need (logic in sparkdeploy.spec.recipe)."""

from __future__ import annotations

import fnmatch

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.spec.project import project_root
from sparkdeploy.spec.recipe import RepoRef
from sparkdeploy.spec.recipe_loading import load_all_recipes

# A recipe's [prefetch] patterns: include, exclude.
Patterns = tuple[tuple[str, ...], tuple[str, ...]]


@task(name="catalog")
def repos_of_deployable_recipes(pattern: str = "*") -> dict[Patterns, list[RepoRef]]:
    """Every repo named by a recipe matching `pattern` (a glob on recipe names) that is not
    blocked, each once per [prefetch] patterns its recipes give, in recipe order."""
    logger = get_run_logger()
    by_patterns: dict[Patterns, list[RepoRef]] = {}
    for name, recipe in load_all_recipes(project_root() / "recipes").items():
        if not fnmatch.fnmatchcase(name, pattern):
            continue
        if recipe.blocked_reason is not None:
            logger.info("skipping blocked recipe %s: %s", name, recipe.blocked_reason)
            continue
        patterns = (tuple(recipe.prefetch.include), tuple(recipe.prefetch.exclude))
        repos = by_patterns.setdefault(patterns, [])
        repos += [repo for repo in recipe.hf_repos if repo not in repos]
    for (include, exclude), repos in by_patterns.items():
        logger.info(
            "%d repos%s: %s",
            len(repos),
            f" (include {list(include)}, exclude {list(exclude)})" if include or exclude else "",
            ", ".join(repo.repo for repo in repos),
        )
    return by_patterns
