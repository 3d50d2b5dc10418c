"""Container labels are untrusted: the form check (unit), and hostile containers on a lab node
that teardown, status and boot must neither follow out of the runs dir, nor load a file by,
nor stop another live deployment for."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.cluster import Lab
from sparkdeploy.errors import ContainerStartError, SparkDeployError, TeardownError
from sparkdeploy.remote.ssh import cached_connection
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.labels import (
    DEPLOYMENT_LABEL,
    NODE_LABEL,
    RANK_LABEL,
    RECIPE_LABEL,
    label_problems,
)
from sparkdeploy.spec.plan import deployment_id, make_plan
from sparkdeploy.spec.project import find_recipe, find_recipe_by_name
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.steps.boot import stop_stale
from sparkdeploy.steps.status import cluster_status
from sparkdeploy.steps.teardown import remove_labelled, teardown


def _labels(
    deployment: str, recipe: str = "lab-single", node: str = "node1", rank: str = "0"
) -> dict[str, str]:
    return {
        DEPLOYMENT_LABEL: deployment,
        RECIPE_LABEL: recipe,
        NODE_LABEL: node,
        RANK_LABEL: rank,
    }


def test_our_own_labels_pass() -> None:
    recipe = "a-recipe-name-longer-than-forty-characters-for-the-prefix.v2"
    ours = deployment_id(recipe, ["node1", "node2"])
    assert label_problems(_labels(ours, recipe), "node1") == []
    assert label_problems(_labels(deployment_id("lab-single", ["n"]), node="n"), "n") == []


@pytest.mark.parametrize(
    ("labels", "complaint"),
    [
        (_labels("/tmp/x"), "deployment '/tmp/x' is not"),
        (_labels("../../x"), "deployment '../../x' is not"),
        (_labels("lab-single-0badc0de/.."), "is not <recipe>"),
        (_labels("lab-single-0BADC0DE"), "is not <recipe>"),
        (_labels("lab-single-0badc0de\n"), "is not <recipe>"),
        (_labels("x-0badc0de", recipe="/etc/passwd"), "recipe '/etc/passwd' is not"),
        (_labels("x-0badc0de", recipe=".."), "recipe '..' is not"),
        (_labels("x-0badc0de", recipe="x"), None),
        (_labels("other-0badc0de"), "is not of recipe 'lab-single'"),
        (_labels("lab-single-0badc0de", node="node2"), "node 'node2' is not 'node1'"),
        (_labels("lab-single-0badc0de", rank="-1"), "rank '-1' is not a number"),
        ({DEPLOYMENT_LABEL: "lab-single-0badc0de"}, "recipe '' is not"),
    ],
)
def test_malformed_labels_are_named(labels: dict[str, str], complaint: str | None) -> None:
    problems = "; ".join(label_problems(labels, "node1"))
    if complaint is None:
        assert problems == ""
    else:
        assert complaint in problems


def test_a_recipe_name_is_never_a_path(tmp_path: Path) -> None:
    (tmp_path / "recipes" / "r").mkdir(parents=True)
    (tmp_path / "recipes" / "r" / "recipe.toml").write_text("")
    (tmp_path / "evil.toml").write_text("")
    assert find_recipe_by_name("r", tmp_path) == tmp_path / "recipes" / "r" / "recipe.toml"
    for name in ("../evil.toml", str(tmp_path / "evil.toml"), "evil.toml", "..", ".hidden"):
        with pytest.raises(SparkDeployError, match="no recipe named"):
            find_recipe_by_name(name, tmp_path)


def test_teardown_refuses_a_deployment_id_that_is_a_path(tmp_path: Path) -> None:
    with pytest.raises(TeardownError, match=r"deployment '\.\./\.\./x' is not"):
        teardown("../../x", {}, str(tmp_path))


# name -> labels of the hostile containers put on node1
HOSTILE = {
    "hostile-relative": _labels("../../escaped"),
    "hostile-absolute": _labels("/tmp/escaped-absolute"),
    "hostile-recipe-path": _labels("x-0badc0de", recipe="../../../../etc/hostname"),
    "hostile-node": _labels("lab-single-0badc0de", node="node3"),
    # Well-formed, but not what lab-single on node1 plans: never ours in status.
    "hostile-mismatch": _labels("lab-single-0badc0de"),
    # Well-formed: a deployment the node lock says holds node1 in the boot check.
    "hostile-live": _labels("lab-live-0badc0de", recipe="lab-live"),
}


@pytest.mark.lab
def test_hostile_labels_cannot_steer_teardown_status_or_boot(
    lab_cluster: Lab, lab_engine_image: str, tmp_path: Path
) -> None:
    node = "node1"
    runner = cached_connection(lab_cluster.ssh_target(node))
    targets = {node: lab_cluster.ssh_target(node)}
    runs_dir = tmp_path / "a" / "b" / "runs"

    def exists(name: str) -> bool:
        listed = runner.run(["docker", "ps", "-a", "-q", "--filter", f"name=^{name}$"], timeout=60)
        return bool(listed.stdout.strip())

    try:
        for name, labels in HOSTILE.items():
            argv = ["docker", "run", "-d", "--name", name]
            for key, value in labels.items():
                argv += ["--label", f"{key}={value}"]
            runner.run([*argv, lab_engine_image, "sleep", "600"], timeout=300)

        # Status: a row for each malformed one, never re-planned; the mismatch does not re-plan.
        statuses = {
            s.containers[0].name: s
            for s in cluster_status(load_cluster(lab_cluster.inventory_path))
            if s.containers[0].name in HOSTILE
        }
        assert set(statuses) == set(HOSTILE)
        for name in ("hostile-relative", "hostile-absolute", "hostile-recipe-path", "hostile-node"):
            assert statuses[name].plan is None
            assert statuses[name].health.startswith("labels are not ours"), statuses[name]
        assert statuses["hostile-mismatch"].plan is None
        assert "cannot re-plan" in statuses["hostile-mismatch"].health
        assert "not lab-single-0badc0de" in statuses["hostile-mismatch"].health

        # Boot: a container of the deployment that holds the node is an error naming it, and
        # nothing is stopped.
        plan = make_plan(
            load_recipe(find_recipe("lab-single")),
            load_cluster(lab_cluster.inventory_path),
            [node],
        )
        with pytest.raises(
            ContainerStartError, match="hostile-live of deployment lab-live-0badc0de"
        ):
            stop_stale(plan, [node], held_by={node: "lab-live-0badc0de"})
        assert all(exists(name) for name in HOSTILE)

        # Teardown (everything labelled, as boot's stale sweep asks): the well-formed ones go,
        # their logs under runs_dir; the malformed ones are left alone and nothing is written
        # outside runs_dir.
        logged: list[str] = []
        removed = remove_labelled(targets, DEPLOYMENT_LABEL, str(runs_dir), log=logged.append)
        assert sorted(c.name for c in removed) == ["hostile-live", "hostile-mismatch"]
        for container in removed:
            assert Path(container.log_path).resolve().is_relative_to(runs_dir)
        for name in ("hostile-relative", "hostile-absolute", "hostile-recipe-path", "hostile-node"):
            assert exists(name), name
            assert any(name in line and "not ours" in line for line in logged), logged
        assert not (tmp_path / "a" / "escaped").exists()
        assert not Path("/tmp/escaped-absolute").exists()
        assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b"]
    finally:
        runner.run(["docker", "rm", "--force", *HOSTILE], timeout=120, check=False)
