"""A rotated secret is rolled out (issue 23.7).

The spec label masks secret values, so an ensure compared nothing of them: a changed HF token,
API key or secret_env value was "already serving". The plan task now labels each container with
a keyed digest of its secret values (HMAC-SHA256, its key a Prefect Secret block the nodes never
see), which running_copy compares.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from secrets import token_hex

import pytest
from pydantic import SecretStr
from test_result_storage import planning_inventory, write_secret_recipe
from test_running_copy import READY, as_planned

from sparkdeploy.secrecy import keyed_digest
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import SECRETS_LABEL, Plan, make_plan, with_secrets_label
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.steps.running_copy import judge_running_copy
from tasks.plan import SECRETS_DIGEST_KEY_BLOCK, plan_deployment, secrets_digest_key

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "clusters" / "dgx-spark-4.toml"
KEY = bytes(range(32))


def _plan(tmp_path: Path, api_key: str, env_secret: str) -> Plan:
    recipe = tmp_path / "lab-secret"
    recipe.mkdir(exist_ok=True)
    write_secret_recipe(recipe, api_key, env_secret)
    return make_plan(load_recipe(recipe / "recipe.toml"), load_cluster(EXAMPLE))


def test_the_label_is_a_keyed_digest_that_changes_with_any_value(tmp_path: Path) -> None:
    value = "sentinel-api-key"
    plan = with_secrets_label(_plan(tmp_path, value, "sentinel-env"), KEY)
    [label] = {node.container.labels[SECRETS_LABEL] for node in plan.nodes}
    again = with_secrets_label(_plan(tmp_path, value, "sentinel-env"), KEY)
    assert {node.container.labels[SECRETS_LABEL] for node in again.nodes} == {label}
    for rotated in (
        _plan(tmp_path, value, "sentinel-env2"),
        _plan(tmp_path, "other", "sentinel-env"),
    ):
        assert with_secrets_label(rotated, KEY).nodes[0].container.labels[SECRETS_LABEL] != label
    other_key = with_secrets_label(plan, bytes(32)).nodes[0].container.labels[SECRETS_LABEL]
    assert other_key != label  # keyed: who has no key cannot test a guess against it
    unkeyed = {
        hashlib.sha256(text.encode()).hexdigest()
        for text in (value, "sentinel-env", f"VLLM_API_KEY={value}")
    }
    shown = plan.model_dump_json()
    assert value not in shown
    assert not any(digest[:16] in shown for digest in unkeyed)
    # the spec label does not move with a secret: the secrets label says why a copy differs
    assert (
        plan.nodes[0].container.labels["sparkdeploy.spec"]
        == (_plan(tmp_path, "other", "x").nodes[0].container.labels["sparkdeploy.spec"])
    )


def test_keyed_digest_reads_names_and_values() -> None:
    one = keyed_digest({"A": SecretStr("1"), "B": SecretStr("2")}, KEY)
    assert one == keyed_digest({"B": SecretStr("2"), "A": SecretStr("1")}, KEY)
    assert one != keyed_digest({"A": SecretStr("12"), "B": SecretStr("")}, KEY)
    assert one != keyed_digest({"A": SecretStr("2"), "B": SecretStr("1")}, KEY)


def test_a_plan_without_secrets_gets_no_secrets_label() -> None:
    plan = make_plan(
        load_recipe(ROOT / "recipes" / "lab-single" / "recipe.toml"), load_cluster(EXAMPLE)
    )
    assert SECRETS_LABEL not in with_secrets_label(plan, KEY).nodes[0].container.labels


@pytest.mark.usefixtures("prefect_harness")
def test_a_rotated_secret_makes_the_running_copy_different(tmp_path: Path) -> None:
    recipe = tmp_path / "lab-secret"
    recipe.mkdir()
    cluster = str(planning_inventory(tmp_path))
    api_key = f"sentinel{token_hex(8)}"
    write_secret_recipe(recipe, api_key, "first-token")
    started = plan_deployment(str(recipe), cluster)
    facts = as_planned(started)  # the containers the deploy of that plan started

    unchanged = plan_deployment(str(recipe), cluster)
    copy = judge_running_copy(unchanged, facts, context_digest=None, probe_outcome=READY)
    assert copy.state == "serving", copy.reason

    write_secret_recipe(recipe, api_key, "rotated-token")  # a rotated HF token, say
    rotated = plan_deployment(str(recipe), cluster)
    copy = judge_running_copy(rotated, facts, context_digest=None, probe_outcome=READY)
    assert copy.state == "different", copy.reason
    assert "secret values" in copy.reason
    assert "rotated-token" not in copy.reason


@pytest.mark.usefixtures("prefect_harness")
def test_the_key_is_made_once_and_kept_off_the_nodes() -> None:
    from prefect.blocks.system import Secret

    key = secrets_digest_key()
    assert key == secrets_digest_key()
    assert len(key) == 64
    assert Secret.load(SECRETS_DIGEST_KEY_BLOCK).get().encode() == key  # type: ignore[union-attr]
