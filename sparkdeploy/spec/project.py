"""Where recipes, inventories and image dirs live, and how a name becomes a path.

The CLI and the flows resolve names the same way: a recipe name is recipes/<name>/recipe.toml,
a cluster name is clusters/<name>.toml or, for a lab brought up by `python -m lab up --name
NAME`, the inventory the lab wrote at <lab root>/<NAME>/cluster.toml.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from sparkdeploy.errors import RecipeError, SparkDeployError
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import Plan, make_plan
from sparkdeploy.spec.recipe import Recipe
from sparkdeploy.spec.recipe_loading import load_recipe, recipe_id_for, recipe_paths
from sparkdeploy.spec.tomlfile import load_toml

ROOT_ENV = "SPARKDEPLOY_ROOT"
LAB_ROOT_ENV = "SPARKDEPLOY_LAB_ROOT"
VARIANTS_DIR_ENV = "SPARKDEPLOY_VARIANTS_DIR"
# Where labs keep their state, NAS and inventory. Not under /tmp, /var, /run or /etc: a lab
# node mounts its own over those, which would hide the lab's files from it.
DEFAULT_LAB_ROOT = Path("/srv/sparkdeploy-lab")
# The package sits at the project root; a worker's flow runs find recipes/ from here.
DEFAULT_ROOT = Path(__file__).resolve().parents[2]


def project_root() -> Path:
    return Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT)


def lab_root() -> Path:
    return Path(os.environ.get(LAB_ROOT_ENV) or DEFAULT_LAB_ROOT)


def variants_dir() -> Path:
    """Where the compare flow writes recipe variants (sparkdeploy.spec.recipe_variant) on the flow
    host: SPARKDEPLOY_VARIANTS_DIR, else ~/.cache/sparkdeploy/variants."""
    configured = os.environ.get(VARIANTS_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "sparkdeploy" / "variants"


def _is_path(value: str) -> bool:
    return value.endswith(".toml") or "/" in value or value in (".", "..")


def find_recipe(value: str, root: Path | None = None) -> Path:
    """recipes/<value>/recipe.toml, or value itself when it is a path (a file or a recipe dir)."""
    if _is_path(value):
        path = Path(value)
        return path / "recipe.toml" if path.is_dir() else path
    return find_recipe_by_name(value, root)


def recipe_id_named(value: str) -> str:
    """The recipe id `value` (a name or path, as find_recipe takes it) names: what its
    containers' recipe label says. Read from the value alone, since the recipe may be gone."""
    if not _is_path(value):
        return value
    path = Path(value)
    return recipe_id_for(path if value.endswith(".toml") else path / "recipe.toml")


def find_recipe_by_name(name: str, root: Path | None = None) -> Path:
    """recipes/<name>/recipe.toml, never a path given as the name: for names read from where
    anyone can write them (a container's labels)."""
    root = root or project_root()
    by_name = root / "recipes" / name / "recipe.toml"
    if _is_path(name) or name.startswith(".") or not by_name.exists():
        known = ", ".join(path.parent.name for path in recipe_paths(root / "recipes"))
        raise SparkDeployError(
            f"no recipe named {name!r} under {root / 'recipes'} (known: {known or 'none'})"
        )
    return by_name


def find_cluster(value: str, root: Path | None = None) -> Path:
    """clusters/<value>.toml, a running lab's inventory, or value itself as a path."""
    root = root or project_root()
    if _is_path(value):
        return Path(value)
    labs = lab_root()
    for candidate in (root / "clusters" / f"{value}.toml", labs / value / "cluster.toml"):
        if candidate.exists():
            return candidate
    known = [path.stem for path in sorted((root / "clusters").glob("*.toml"))]
    known += [path.parent.name for path in sorted(labs.glob("*/cluster.toml"))]
    raise SparkDeployError(
        f"no cluster named {value!r}: neither {root}/clusters/{value}.toml nor "
        f"{labs}/{value}/cluster.toml exists (known: {', '.join(known) or 'none'}; "
        "`python -m lab up --name NAME` writes a lab's)"
    )


def find_image_dir(docker_image_dir: str, root: Path | None = None) -> Path | None:
    """images/<docker_image_dir> when it holds a Dockerfile, else None: the image was built
    elsewhere (by hand on the nodes, say), so it can be used as the nodes hold it but not built
    here (sparkdeploy.steps.image)."""
    path = image_dir_path(docker_image_dir, root)
    return path if (path / "Dockerfile").is_file() else None


def image_dir_path(docker_image_dir: str, root: Path | None = None) -> Path:
    """Where a recipe's docker_image_dir is, whether it exists or not."""
    return (root or project_root()) / "images" / docker_image_dir


def image_dir_fix(docker_image_dir: str, docker_image: str) -> str:
    """What to do about a docker_image_dir this checkout lacks (validate's and a deploy's)."""
    return (
        f"add the image's build context (with its Dockerfile) at images/{docker_image_dir}/,"
        f" or remove docker_image_dir to use {docker_image} as the nodes hold it or pull it"
        " from its registry"
    )


def missing_image_dir_problem(
    recipe_path: Path, recipe: Recipe, root: Path | None = None
) -> str | None:
    """The recipe's docker_image_dir, when this checkout lacks it, as validate's problem line.

    An error, not a warning: the file names a build context that is not here, and a deploy
    refuses the recipe unless every node holds its image; removing the key costs nothing where
    they do, since an image every node holds with one ID is used as it is either way.
    """
    if recipe.docker_image_dir is None:
        return None
    if find_image_dir(recipe.docker_image_dir, root) is not None:
        return None
    where = load_toml(recipe_path, RecipeError).where(("docker_image_dir",))
    dockerfile = image_dir_path(recipe.docker_image_dir, root) / "Dockerfile"
    return (
        f"{where}: docker_image_dir {recipe.docker_image_dir!r}: {dockerfile} does not exist,"
        f" so {recipe.docker_image} cannot be built here and a deploy refuses the recipe unless"
        " every node already holds the image with one ID; "
        + image_dir_fix(recipe.docker_image_dir, recipe.docker_image)
    )


def load_plan(
    recipe: str, cluster: str, nodes: Sequence[str] | None = None, root: Path | None = None
) -> Plan:
    """The plan for a recipe and a cluster given by name or path (see find_recipe/find_cluster)."""
    return make_plan(
        load_recipe(find_recipe(recipe, root)), load_cluster(find_cluster(cluster, root)), nodes
    )
