"""A quality gate's outcome (sparkdeploy.steps.quality): each eval's score against its threshold,
over how many samples and in how long, as plain data that the gate's artifact and a comparison
of two deployments show alike; and the failure that names every eval that did not pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sparkdeploy.errors import QualityFailed

Bound = Literal["min", "max"]
# rate: a share (the typo rate), shown in percent; percent: a score out of 100; score: a tool's.
Unit = Literal["rate", "percent", "score"]


def format_value(value: float, unit: Unit) -> str:
    if unit == "rate":
        return f"{value * 100:.2f} %"
    if unit == "percent":
        return f"{value:.1f} %"
    return f"{value:g}"


@dataclass(frozen=True)
class EvalResult:
    """One eval's outcome."""

    name: str
    score: float | None  # None: the eval gave no score; error says why
    threshold: float
    bound: Bound  # min: the score must be at least the threshold; max: at most
    samples: int | None  # the requests (or words, questions) behind the score; None: not known
    seconds: float
    unit: Unit = "score"
    evidence: str = ""  # what the score is made of (typos found, wrong answers, tool output)
    error: str | None = None

    @property
    def passed(self) -> bool:
        if self.score is None:
            return False
        return self.score >= self.threshold if self.bound == "min" else self.score <= self.threshold

    @property
    def score_text(self) -> str:
        return "no score" if self.score is None else format_value(self.score, self.unit)

    @property
    def threshold_text(self) -> str:
        return f"{'≥' if self.bound == 'min' else '≤'} {format_value(self.threshold, self.unit)}"

    def verdict(self) -> str:
        """`typo_rate 0.52 % over 20 samples: above the threshold ≤ 0.20 %`, or why no score."""
        if self.score is None:
            return f"{self.name}: no score: {self.error}"
        over = f" over {self.samples} samples" if self.samples is not None else ""
        if self.passed:
            return f"{self.name} {self.score_text}{over}: within {self.threshold_text}"
        side = "below" if self.bound == "min" else "above"
        evidence = f" ({self.evidence})" if self.evidence else ""
        return (
            f"{self.name} {self.score_text}{over}: {side} the threshold "
            f"{self.threshold_text}{evidence}"
        )

    def row(self) -> dict[str, str]:
        """A row of a table artifact."""
        return {
            "eval": self.name,
            "result": "pass" if self.passed else "FAIL",
            "score": self.score_text,
            "threshold": self.threshold_text,
            "samples": "—" if self.samples is None else str(self.samples),
            "seconds": f"{self.seconds:.1f}",
            "evidence": self.error or self.evidence,
        }


@dataclass(frozen=True)
class QualityReport:
    served_model_name: str
    endpoint: str
    results: tuple[EvalResult, ...]

    @property
    def passed(self) -> bool:
        return all(result.passed for result in self.results)

    @property
    def failed(self) -> list[EvalResult]:
        return [result for result in self.results if not result.passed]

    def result(self, name: str) -> EvalResult:
        return next(result for result in self.results if result.name == name)

    def table_rows(self) -> list[dict[str, str]]:
        return [result.row() for result in self.results]

    def raise_if_failed(self) -> None:
        if self.passed:
            return
        lines = "\n".join(f"  {result.verdict()}" for result in self.failed)
        raise QualityFailed(
            f"quality gate of {self.served_model_name!r} at {self.endpoint}: "
            f"{len(self.failed)} of {len(self.results)} evals failed:\n{lines}\n"
            "fix: an eval without a score names its cause and its last lines; a score past its "
            "threshold is the build's (compare it with the last good image or checkpoint), "
            "unless the recipe's threshold is wrong"
        )
