"""Our container labels, and the check that a container's labels have the form ours have.

Labels are untrusted input: anyone who can start a container on a node can set any label. A
label value is therefore checked against the form sparkdeploy.spec.container gives it before it
is used at all (as part of a log path in teardown, as a recipe name in status, as a deployment
to stop in boot): deployment `<recipe[:40]>-<8 hex>` (plan.deployment_id), recipe a recipe dir
name, node the node the container was found on, rank digits. A container whose labels fail is
reported and left alone. The started-by label is only ever compared with a flow run's id.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from sparkdeploy.spec.container import LABEL_PREFIX

DEPLOYMENT_LABEL = f"{LABEL_PREFIX}deployment"
RECIPE_LABEL = f"{LABEL_PREFIX}recipe"
NODE_LABEL = f"{LABEL_PREFIX}node"
RANK_LABEL = f"{LABEL_PREFIX}rank"
# The Prefect flow run that started the container: a cancelled or crashed run removes only what
# it started itself, never the copy an earlier run of its deployment left serving.
STARTED_BY_LABEL = f"{LABEL_PREFIX}started-by"

# A recipe dir name (recipes/<name>/), like an inventory node name: never a path, never "..".
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_DEPLOYMENT_ID = re.compile(r"(?P<recipe>[A-Za-z0-9][A-Za-z0-9_.-]{0,39})-[0-9a-f]{8}")
_RANK = re.compile(r"[0-9]{1,4}")


def deployment_id_problem(value: str) -> str | None:
    """Why `value` is not a deployment id as plan.deployment_id makes them (None: it is one)."""
    if _DEPLOYMENT_ID.fullmatch(value) is None:
        return f"deployment {value!r} is not <recipe>-<8 hex digits>"
    return None


def deployment_recipe(deployment_id: str) -> str | None:
    """The recipe part of a deployment id (its recipe id, cut at 40 characters); None when the
    value is no deployment id. What a node lock record, which names no recipe, is matched by."""
    match = _DEPLOYMENT_ID.fullmatch(deployment_id)
    return match["recipe"] if match else None


def label_problems(labels: Mapping[str, str], node: str) -> list[str]:
    """Why the labels of a container found on `node` are not ours; empty when they are."""
    deployment = labels.get(DEPLOYMENT_LABEL, "")
    recipe = labels.get(RECIPE_LABEL, "")
    problems = []
    if (problem := deployment_id_problem(deployment)) is not None:
        problems.append(problem)
    if _NAME.fullmatch(recipe) is None:
        problems.append(f"recipe {recipe!r} is not a recipe dir name")
    elif not problems and not deployment.startswith(f"{recipe[:40]}-"):
        problems.append(f"deployment {deployment!r} is not of recipe {recipe!r}")
    if labels.get(NODE_LABEL) != node:
        problems.append(f"node {labels.get(NODE_LABEL)!r} is not {node!r}, where it runs")
    if _RANK.fullmatch(labels.get(RANK_LABEL, "")) is None:
        problems.append(f"rank {labels.get(RANK_LABEL)!r} is not a number")
    return problems
