"""The smoke test's verdict: each check with its name, evidence and figures, the engine's own
figures beside ours, and the failure that names every failed check."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparkdeploy.errors import SmokeFailed
from sparkdeploy.vllm.metrics import EngineFigure


@dataclass(frozen=True)
class SmokeCheck:
    name: str
    passed: bool
    evidence: str
    figures: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SmokeReport:
    base_url: str
    served_model_name: str
    checks: list[SmokeCheck]
    # What the engine's /metrics says the smoke requests did, beside our own count (informative:
    # another client's requests in the meantime count too).
    engine: list[EngineFigure] = field(default_factory=list)
    engine_error: str | None = None  # why there are no engine figures
    head_node: str = ""

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def failed(self) -> list[SmokeCheck]:
        return [check for check in self.checks if not check.passed]

    def check(self, name: str) -> SmokeCheck:
        return next(check for check in self.checks if check.name == name)

    def table_rows(self) -> list[dict[str, str]]:
        """Rows for a Prefect table artifact: the checks, then the engine's own figures."""
        rows = [
            {
                "check": check.name,
                "result": "pass" if check.passed else "FAIL",
                "evidence": check.evidence,
                "figures": ", ".join(f"{key}={value:g}" for key, value in check.figures.items()),
            }
            for check in self.checks
        ]
        engine = [(f"engine /metrics: {figure.name}", figure.text()) for figure in self.engine]
        if self.engine_error:
            engine.append(("engine /metrics", self.engine_error))
        rows += [
            {"check": name, "result": "info", "evidence": evidence, "figures": ""}
            for name, evidence in engine
        ]
        return rows

    def raise_if_failed(self) -> None:
        if self.passed:
            return
        lines = "\n".join(f"  {check.name}: {check.evidence}" for check in self.failed)
        raise SmokeFailed(
            f"smoke test of {self.served_model_name!r} at {self.base_url}"
            + (f" (head node {self.head_node})" if self.head_node else "")
            + " failed "
            f"{len(self.failed)} of {len(self.checks)} checks:\n{lines}\n"
            "fix: the evidence names the failure mode (docs/field.md, 'Silent failure modes'); "
            "keep the deployment up to inspect it, or compare with the recipe's last good image"
        )
