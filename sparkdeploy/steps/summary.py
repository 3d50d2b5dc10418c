"""What a deploy did, for the summary artifact: where it ran, each step's time, the endpoint."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from pydantic import BaseModel

from sparkdeploy.spec.memory import FitReport
from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.readiness_gate import TimelineEntry
from sparkdeploy.steps.smoke_test import CANARIES


class StepClock:
    """Wall time of each named step, in the order the steps ran."""

    def __init__(self) -> None:
        self._durations: dict[str, float] = {}

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self._durations[name] = time.monotonic() - started

    def durations(self) -> dict[str, float]:
        return dict(self._durations)


class NodeRow(BaseModel):
    node: str
    rank: int
    role: str
    container: str
    host: str


class DeploySummary(BaseModel):
    deployment_id: str
    recipe: str
    cluster: str
    endpoint: str
    served_model_name: str
    nodes: list[NodeRow]
    step_seconds: dict[str, float]
    ready_after_s: float | None
    # The head's boot markers: seconds from the gate's start (the containers' start) to each.
    head_markers_s: dict[str, float] = {}
    fit: FitReport | None = None  # None when the deploy skipped the fit check
    # The figures the head's log gave (vllm_markers' named groups: weights_load_s,
    # model_load_gib, kv_cache_gib, kv_cache_tokens, max_concurrency, init_engine_s, ...).
    head_figures: dict[str, float] = {}
    # What the deploy found instead of deploying (ensure: the deployment already served).
    note: str = ""

    @classmethod
    def of(
        cls,
        plan: Plan,
        step_seconds: dict[str, float],
        *,
        ready_after_s: float | None,
        timeline: Sequence[TimelineEntry] = (),
        head_figures: dict[str, float] | None = None,
        note: str = "",
    ) -> DeploySummary:
        head = plan.head.node
        return cls(
            deployment_id=plan.deployment_id,
            recipe=plan.recipe,
            cluster=plan.cluster,
            endpoint=plan.endpoint,
            served_model_name=plan.served_model_name,
            nodes=[
                NodeRow(
                    node=node.node,
                    rank=node.rank,
                    role=node.role,
                    container=node.container.name,
                    host=node.ssh.host,
                )
                for node in plan.nodes
            ],
            step_seconds=step_seconds,
            ready_after_s=ready_after_s,
            head_markers_s={
                entry.marker: entry.seconds for entry in timeline if entry.node == head
            },
            fit=plan.fit,
            head_figures=dict(head_figures or {}),
            note=note,
        )

    def markdown(self) -> str:
        lines = [
            f"# {self.recipe} on {self.cluster}",
            "",
            f"Endpoint **{self.endpoint}**, served model `{self.served_model_name}`, "
            f"deployment `{self.deployment_id}`.",
            *(["", self.note] if self.note else []),
            "",
            "| node | rank | role | container | host |",
            "|---|---|---|---|---|",
            *(
                f"| {n.node} | {n.rank} | {n.role} | `{n.container}` | {n.host} |"
                for n in self.nodes
            ),
            "",
            "| step | seconds |",
            "|---|---|",
            *(f"| {step} | {seconds:.1f} |" for step, seconds in self.step_seconds.items()),
        ]
        if self.ready_after_s is not None:
            lines += ["", f"The engine was ready {self.ready_after_s:.1f} s after the gate began."]
        if self.head_markers_s:
            lines += ["", "| head's boot marker | seconds |", "|---|---|"]
            lines += [f"| {name} | {sec:.1f} |" for name, sec in self.head_markers_s.items()]
        if self.fit is not None:
            lines += ["", self.fit.markdown()]
        lines += [
            "",
            "Try it:",
            "",
            "```",
            shlex.join(
                [
                    "curl",
                    f"{self.endpoint}/v1/chat/completions",
                    "-H",
                    "Content-Type: application/json",
                    "-d",
                    json.dumps(
                        {
                            "model": self.served_model_name,
                            "messages": [{"role": "user", "content": CANARIES[0].prompt}],
                        }
                    ),
                ]
            ),
            "```",
        ]
        return "\n".join(lines)
