"""Ensure semantics: is the deployment a plan describes already running, as planned, and healthy?

A scheduled deploy asks this first. The same deployment (same recipe and nodes: the same deployment
id) runs as planned when every node of the plan has exactly one container of it, started from this
plan (the spec label, sparkdeploy.spec.plan.spec_digest: revisions, args, env, mounts) with its
secret values (the secrets label, their keyed digest: sparkdeploy.spec.plan.with_secrets_label),
from the image the recipe's reference names on that node now (a deploy boots exactly that:
sparkdeploy.steps.image leaves a present image alone) and, for an image built from images/<dir>,
from the build context as it is now. It is healthy when every container runs and the head answers
/health and lists the served model; the smoke test then has the last word.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sparkdeploy.remote.docker_cli import ContainerInfo, list_containers, on_nodes
from sparkdeploy.remote.engine_http import ProbeOutcome
from sparkdeploy.remote.node_probe import probe
from sparkdeploy.remote.runner import Runner
from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.spec.labels import DEPLOYMENT_LABEL
from sparkdeploy.spec.plan import SECRETS_LABEL, SPEC_LABEL, Plan
from sparkdeploy.steps.image.source import CONTEXT_LABEL

State = Literal["absent", "different", "unhealthy", "serving"]


@dataclass(frozen=True)
class NodeFacts:
    containers: list[ContainerInfo]  # of the deployment, on this node
    image_id: str | None  # what the recipe's image reference names on the node now
    image_context: str | None  # that image's build-context digest label, when it has one


@dataclass(frozen=True)
class RunningCopy:
    state: State
    reason: str
    containers: tuple[str, ...] = ()  # the ids of the deployment's containers found, sorted

    @property
    def serving(self) -> bool:
        return self.state == "serving"

    def made_to_serve_since(self, earlier: RunningCopy) -> bool:
        """Serving now from other containers than an earlier look found: another deploy (a
        repair, a scheduled ensure) started them in between."""
        return self.serving and self.containers != earlier.containers


def node_facts(plan: Plan) -> dict[str, NodeFacts]:
    """Each node's containers of the deployment and the image its reference names: one round
    trip per node, all nodes at once."""
    label = f"{DEPLOYMENT_LABEL}={plan.deployment_id}"

    def facts(runner: Runner, node: str) -> NodeFacts:
        containers = list_containers(runner, node, label)
        found: dict[str, Any] | None = probe(runner, node, "image", {"image": plan.docker_image})[
            "image"
        ]
        return NodeFacts(
            containers=containers,
            image_id=found["id"] if found else None,
            image_context=found["labels"].get(CONTEXT_LABEL) if found else None,
        )

    return on_nodes(plan_targets(plan), facts)


def _short(image_id: str | None) -> str:
    return (image_id or "none")[:19]


def judge_running_copy(
    plan: Plan,
    facts: Mapping[str, NodeFacts],
    *,
    context_digest: str | None,
    probe_outcome: ProbeOutcome | None,
) -> RunningCopy:
    """What runs of `plan`'s deployment compared with the plan (module docstring).

    `context_digest`: the build context's digest now, for a recipe with docker_image_dir.
    `probe_outcome`: the head's /health and /v1/models, asked once the containers were found
    as planned (None: not asked)."""
    dep = plan.deployment_id
    ids = tuple(sorted(c.id for node in facts.values() for c in node.containers))
    if not ids:
        return RunningCopy("absent", f"no container of {dep} on {', '.join(facts)}")
    problems: list[str] = []
    unhealthy: list[str] = []
    for node in plan.nodes:
        found = facts[node.node]
        if len(found.containers) != 1:
            unhealthy.append(f"{node.node} has {len(found.containers)} containers of it")
            continue
        container = found.containers[0]
        expected = node.container.labels[SPEC_LABEL]
        started_from = container.labels.get(SPEC_LABEL)
        if started_from != expected:
            problems.append(
                f"{node.node} runs spec {started_from or 'unknown'}, the recipe now gives"
                f" {expected} (the recipe or inventory changed since it was started)"
            )
        elif container.labels.get(SECRETS_LABEL) != node.container.labels.get(SECRETS_LABEL):
            problems.append(
                f"{node.node} was started with other secret values than the recipe gives now"
                " (their keyed digest differs: a rotated API key, HF token or secret_env value)"
            )
        if container.image_id != found.image_id:
            problems.append(
                f"{node.node} runs image {_short(container.image_id)}, {plan.docker_image} now"
                f" names {_short(found.image_id)} there"
            )
        elif context_digest is not None and found.image_context != context_digest:
            problems.append(
                f"{node.node}'s image was built from another version of"
                f" images/{plan.docker_image_dir}"
            )
        if container.status != "running":
            unhealthy.append(f"{node.node}'s container {container.status} ({container.exit_code})")
    if problems:
        return RunningCopy("different", "; ".join(problems), ids)
    if unhealthy:
        return RunningCopy("unhealthy", "; ".join(unhealthy), ids)
    if probe_outcome is None or not probe_outcome.ready:
        detail = probe_outcome.detail if probe_outcome else "not asked"
        return RunningCopy("unhealthy", f"the head at {plan.endpoint} is not ready: {detail}", ids)
    return RunningCopy("serving", f"{dep} runs as planned and {plan.endpoint} answers", ids)
