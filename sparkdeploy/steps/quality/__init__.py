"""The quality gate: after the smoke test, the evals of the recipe's [quality], each judged
against its threshold (docs/quality.md). The smoke test finds an engine that answers garbage;
this finds one that answers worse than the recipe's bar.

One module per job:
  __init__.py   run_quality(): every eval in the recipe's order, their results in a report
  builtin.py    the built-in evals: typo rate, exact answers, tool-call validity
  prompts.py    what the built-in evals ask
  spelling.py   misspelled words, against the shipped word list (english_words.txt.gz)
  external.py   an external eval: a command on the ops host or an image on the head node,
                its score read from its stdout or its file
The results are sparkdeploy.report.quality's EvalResult, which a comparison shows too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sparkdeploy.remote.ssh import cached_connection
from sparkdeploy.remote.targets import node_target
from sparkdeploy.report.history import artifact_key
from sparkdeploy.report.quality import EvalResult, QualityReport
from sparkdeploy.spec.plan import Plan
from sparkdeploy.spec.project import project_root
from sparkdeploy.spec.quality import Quality
from sparkdeploy.steps.quality.builtin import exact_answers_eval, tool_calls_eval, typo_rate_eval
from sparkdeploy.steps.quality.external import EvalTarget, run_external
from sparkdeploy.steps.smoke_test import SmokeSettings

__all__ = ["QualitySettings", "run_quality"]


@dataclass(frozen=True)
class QualitySettings:
    chat: SmokeSettings  # the endpoint and how to ask it (the recipe's [smoke] options)
    quality: Quality
    target: EvalTarget  # where external evals run and what they are handed

    @classmethod
    def for_plan(cls, plan: Plan, quality: Quality) -> QualitySettings:
        """The gate of a deployment: its endpoint, its recipe's [smoke] options for the built-in
        evals' requests, its head node for image evals and the project's root as the working
        directory of commands."""
        head = node_target(plan.head)
        return cls(
            SmokeSettings.for_plan(plan),
            quality,
            EvalTarget(
                endpoint=plan.endpoint,
                model=plan.served_model_name,
                api_key=plan.api_key,
                workdir=project_root(),
                head_node=plan.head.node,
                head_runner=lambda: cached_connection(head),
                container_name=artifact_key("sparkdeploy-eval", plan.deployment_id),
            ),
        )


def run_quality(settings: QualitySettings) -> QualityReport:
    """Every eval, built-in ones first, in the recipe's order; never raises for a bad score or a
    tool without one (QualityReport.raise_if_failed does)."""
    quality, chat = settings.quality, settings.chat
    results: list[EvalResult] = []
    if quality.typo_rate is not None:
        results.append(typo_rate_eval(chat, quality.typo_rate))
    if quality.exact_answers is not None:
        results.append(exact_answers_eval(chat, quality.exact_answers))
    if quality.tool_calls is not None:
        results.append(tool_calls_eval(chat, quality.tool_calls))
    for index, external in enumerate(quality.external):
        container = f"{settings.target.container_name}-{index}"
        results.append(run_external(external, replace(settings.target, container_name=container)))
    return QualityReport(chat.served_model_name, chat.base_url, tuple(results))
