"""Prefect's result storage holds no secret (issue 23.6).

A plan carries the recipe's secrets as SecretStr, which pickles its value in clear. Nothing
leaked only because Prefect persists no result by default: with
PREFECT_RESULTS_PERSIST_BY_DEFAULT=true every task's result is pickled into the result storage,
and a cached plan could be handed to a later call with the secrets of an earlier recipe. Every
task or flow whose result holds a secret therefore neither persists nor caches it.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import importlib
import json
import pkgutil
import typing
from collections.abc import Iterator
from pathlib import Path
from secrets import token_hex
from typing import Any

import pydantic
import pytest
from prefect import Flow, Task, flow
from prefect.cache_policies import NO_CACHE
from prefect.settings import (
    PREFECT_LOCAL_STORAGE_PATH,
    PREFECT_RESULTS_PERSIST_BY_DEFAULT,
    temporary_settings,
)
from pydantic import SecretStr

import flows
import tasks
from tasks.plan import plan_deployment

ROOT = Path(__file__).parent.parent
SINGLE = ROOT / "recipes" / "lab-single" / "recipe.toml"
EXAMPLE = ROOT / "clusters" / "dgx-spark-4.toml"


def _readable_forms(data: bytes) -> list[bytes]:
    """A stored file as written and as what it encodes: Prefect writes a result as base64 of
    its pickle, alone or as the `result` of a JSON record."""
    forms = [data]
    with contextlib.suppress(ValueError):
        forms.append(base64.b64decode(data))
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        forms.append(base64.b64decode(json.loads(data)["result"]))
    return forms


def _holds_secret(annotation: Any, seen: set[Any] | None = None) -> bool:
    """Whether a value of this type can carry a SecretStr (in a field, an item, a member)."""
    seen = set() if seen is None else seen
    if annotation in seen:
        return False
    seen.add(annotation)
    if annotation is SecretStr:
        return True
    inner = [*typing.get_args(annotation)]
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        inner += [field.annotation for field in annotation.model_fields.values()]
    elif isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        inner += list(typing.get_type_hints(annotation).values())
    return any(_holds_secret(arg, seen) for arg in inner)


def _prefect_objects() -> Iterator[Task[Any, Any] | Flow[Any, Any]]:
    for package in (tasks, flows):
        for module_info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{module_info.name}")
            for value in vars(module).values():
                if isinstance(value, (Task, Flow)) and value.fn.__module__ == module.__name__:
                    yield value


def test_tasks_and_flows_whose_results_hold_secrets_neither_persist_nor_cache_them() -> None:
    holding = {
        obj.name: obj
        for obj in _prefect_objects()
        if _holds_secret(typing.get_type_hints(obj.fn).get("return"))
    }
    assert {"plan", "fit", "watchdog-targets", "status"} <= set(holding)  # the search is real
    wrong = [
        name
        for name, obj in holding.items()
        if obj.persist_result is not False
        or (isinstance(obj, Task) and obj.cache_policy is not NO_CACHE)
    ]
    assert wrong == [], "set persist_result=False (and, on a task, cache_policy=NO_CACHE)"


def planning_inventory(tmp_path: Path) -> Path:
    """The example inventory with the SSH files the plan task checks for, as empty files here."""
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(
        EXAMPLE.read_text()
        .replace('"~/.ssh/known_hosts"', f'"{tmp_path}/known_hosts"')
        .replace('"~/.ssh/id_ed25519"', f'"{tmp_path}/id"')
    )
    (tmp_path / "known_hosts").touch()
    (tmp_path / "id").touch()
    return cluster


def write_secret_recipe(directory: Path, api_key: str, env_secret: str) -> None:
    """lab-single in `directory`, with these values as its --api-key and SENTINEL_TOKEN."""
    text = SINGLE.read_text()
    text = text.replace("args = [\n", f'args = [\n    "--api-key", "{api_key}",\n')
    text = text.replace("[env]\n", f'[env]\nSENTINEL_TOKEN = "{env_secret}"\n')
    (directory / "recipe.toml").write_text(text)


def _env_file_digest(api_key: str, env_secret: str) -> str:
    return hashlib.sha256(
        f"SENTINEL_TOKEN={env_secret}\nVLLM_API_KEY={api_key}\n".encode()
    ).hexdigest()


@flow(name="plan-with-rotating-secrets")
def plan_with_rotating_secrets(recipe: str, cluster: str, secrets_file: str) -> list[str]:
    """Plans the recipe once per line of `secrets_file` (`api_key env_secret`), rewriting its
    secrets before each: the digest of each plan's env file, never the values."""
    digests = []
    for line in Path(secrets_file).read_text().splitlines():
        write_secret_recipe(Path(recipe), *line.split())
        plan = plan_deployment(recipe, cluster)
        digests.append(hashlib.sha256(plan.nodes[0].container.env_file()).hexdigest())
    return digests


@pytest.mark.usefixtures("prefect_harness")
def test_persisted_results_hold_no_secret_and_no_run_reuses_a_stale_plan(tmp_path: Path) -> None:
    recipe = tmp_path / "lab-secret"
    recipe.mkdir()
    cluster = planning_inventory(tmp_path)
    storage = tmp_path / "results"
    runs = [
        [(f"sentinel{token_hex(8)}", f"sentinel{token_hex(8)}") for _ in range(2)] for _ in range(2)
    ]
    with temporary_settings(
        {PREFECT_RESULTS_PERSIST_BY_DEFAULT: True, PREFECT_LOCAL_STORAGE_PATH: storage}
    ):
        for run in runs:
            secrets_file = tmp_path / "secrets"
            secrets_file.write_text("".join(f"{key} {env}\n" for key, env in run))
            digests = plan_with_rotating_secrets(str(recipe), str(cluster), str(secrets_file))
            secrets_file.unlink()
            # each call sees the recipe's secrets of that moment: no cached plan is reused
            assert digests == [_env_file_digest(key, env) for key, env in run]
    stored = [path for path in storage.rglob("*") if path.is_file()]
    assert stored  # the storage is real: the flow's own results went there
    sentinels = [value for run in runs for pair in run for value in pair]
    leaks = [
        str(path)
        for path in stored
        for text in _readable_forms(path.read_bytes())
        if any(sentinel.encode() in text for sentinel in sentinels)
    ]
    assert leaks == []
