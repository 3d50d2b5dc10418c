"""A comparison's verdict asked as a ship rule: "B ships if its score stays >= 88 and its d8192
decode rate is not worse", written `quality>=88, decode@8192 not worse`.

A rule is conditions joined by `,` or `and`; each names a subject and what B must show:
- a subject is an eval of the recipes' [quality] by its name (`quality`: the side's only eval), or
  a benchmark figure at a context depth (`decode@8192`, `decode@d8192`) or at a concurrency level
  (`output@c4`); FIGURE_NAMES lists the figures' short names;
- `not worse` or `better`: B's verdict against A, by the comparison's own noise rules (a
  difference within the noise is the same, so it is not worse);
- `>= X`, `> X`, `<= X`, `< X`: B's own value (a figure in its table's unit: ms for TTFT, tok/s;
  an eval in its score's unit, a rate as a share: `typo_rate <= 0.002`).
A subject the comparison did not measure (a side failed, no such eval) fails its condition: B
does not ship on what was not shown. Parsing is strict: a condition it cannot read is an error
that names it and the grammar, before anything is deployed.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from sparkdeploy.errors import CompareError
from sparkdeploy.report.verdicts import Verdict

SubjectKind = Literal["level", "depth", "eval"]

# The figures a rule may name, by their short names: at a level (c4), at a depth (d8192).
FIGURE_NAMES: dict[SubjectKind, dict[str, str]] = {
    "level": {
        "output": "output_tok_s",
        "requests": "requests_s",
        "decode": "decode_tok_s_p50",
        "ttft": "ttft_p50_s",
        "itl": "itl_p50_s",
        "e2e": "e2e_p50_s",
        "errors": "errors",
    },
    "depth": {
        "decode": "depth_decode_tok_s",
        "ttft": "depth_ttft_s",
        "errors": "depth_errors",
    },
}
COMPARATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "≥": operator.ge,
    ">": operator.gt,
    "<=": operator.le,
    "≤": operator.le,
    "<": operator.lt,
}
VERDICT_PREDICATES: dict[str, frozenset[Verdict]] = {
    "not worse": frozenset({"same", "better"}),
    "better": frozenset({"better"}),
}
GRAMMAR = (
    "write conditions joined by ',' or 'and', each `SUBJECT >= NUMBER` (or >, <=, <) or "
    "`SUBJECT not worse` (or better); SUBJECT an eval's name (`quality`: the only one), or a "
    "figure at a context depth (decode@8192) or at a concurrency level (output@c4), the figures "
    "being " + "; ".join(f"at a {kind}: {', '.join(names)}" for kind, names in FIGURE_NAMES.items())
)

_SPLIT = re.compile(r"\s*,\s*|\s+and\s+", re.IGNORECASE)
_CONDITION = re.compile(
    r"^(?P<name>[A-Za-z][\w.-]*?)(?:@(?P<group>[cd]?)(?P<at>\d+))?\s*"
    r"(?:(?P<comparator>>=|<=|≥|≤|>|<)\s*(?P<value>\S+)|(?P<predicate>not\s+worse|better))$",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Subject:
    kind: SubjectKind
    name: str  # the figure's name (FIGURE_NAMES' values), or the eval's as written
    at: int | None  # the level or the depth; None for an eval
    text: str  # as written: decode@8192


@dataclass(frozen=True)
class Condition:
    text: str
    subject: Subject
    comparator: str | None = None  # with value: B's own value against it
    value: float | None = None
    accepted: frozenset[Verdict] = frozenset()  # else: B's verdict against A is one of these

    def met_by(self, judged: Judged) -> bool | None:
        if self.comparator is not None and self.value is not None:
            if judged.b_value is None:
                return None
            return COMPARATORS[self.comparator](judged.b_value, self.value)
        if judged.verdict == "—":
            return None
        return judged.verdict in self.accepted


@dataclass(frozen=True)
class ShipRule:
    text: str
    conditions: tuple[Condition, ...]

    @property
    def evals(self) -> list[str]:
        """The eval names the rule asks about."""
        return [c.subject.name for c in self.conditions if c.subject.kind == "eval"]


def _subject(name: str, group: str | None, at: str | None, text: str) -> Subject:
    if at is None:
        return Subject("eval", name, None, text)
    kind: SubjectKind = "level" if group and group.lower() == "c" else "depth"
    figure = FIGURE_NAMES[kind].get(name.lower())
    if figure is None:
        raise CompareError(
            f"ship_if: {text!r} names no figure at a {kind}: {', '.join(FIGURE_NAMES[kind])} are"
        )
    return Subject(kind, figure, int(at), text)


def parse_ship_rule(text: str) -> ShipRule:
    """The rule's conditions; CompareError naming the first one it cannot read."""
    parts = [part for part in _SPLIT.split(text.strip()) if part]
    if not parts:
        raise CompareError(f"ship_if is empty: {GRAMMAR}")
    conditions = []
    for part in parts:
        match = _CONDITION.match(part)
        if match is None:
            raise CompareError(f"ship_if: cannot read {part!r}: {GRAMMAR}")
        subject_text = part[: match.end("at") if match["at"] else match.end("name")]
        subject = _subject(match["name"], match["group"], match["at"], subject_text)
        if match["predicate"]:
            predicate = " ".join(match["predicate"].lower().split())
            conditions.append(Condition(part, subject, accepted=VERDICT_PREDICATES[predicate]))
            continue
        try:
            value = float(match["value"])
        except ValueError:
            raise CompareError(
                f"ship_if: {part!r}: {match['value']!r} is not a number: {GRAMMAR}"
            ) from None
        conditions.append(Condition(part, subject, match["comparator"], value))
    return ShipRule(text.strip(), tuple(conditions))


@dataclass(frozen=True)
class Judged:
    """What the comparison shows of a subject: B's value (in the unit a rule writes it in),
    B's verdict against A, and both sides' figures as the table shows them."""

    b_value: float | None
    verdict: Verdict
    shown: str


# How a comparison answers for a subject: what it judged, or why it has nothing to say.
Judge = Callable[[Subject], Judged | str]


@dataclass(frozen=True)
class ConditionOutcome:
    condition: Condition
    met: bool | None  # None: not measured (the condition fails)
    evidence: str

    def text(self) -> str:
        mark = {True: "met", False: "NOT met", None: "NOT measured"}[self.met]
        return f"{self.condition.text}: {mark} ({self.evidence})"


@dataclass(frozen=True)
class ShipVerdict:
    rule: ShipRule
    outcomes: tuple[ConditionOutcome, ...]

    @property
    def ships(self) -> bool:
        return all(outcome.met is True for outcome in self.outcomes)

    def headline(self) -> str:
        return f"{'SHIP' if self.ships else 'DO NOT SHIP'} B ({self.rule.text})"

    def markdown(self) -> list[str]:
        return [
            f"## Ship rule: {self.headline()}",
            "",
            *(f"- {outcome.text()}" for outcome in self.outcomes),
        ]


def judge_rule(rule: ShipRule, judge: Judge) -> ShipVerdict:
    """Each condition against what the comparison shows (`judge`); B ships when all are met."""
    outcomes = []
    for condition in rule.conditions:
        judged = judge(condition.subject)
        if isinstance(judged, str):
            outcomes.append(ConditionOutcome(condition, None, judged))
            continue
        met = condition.met_by(judged)
        evidence = judged.shown + (f"; {judged.verdict}" if judged.verdict != "—" else "")
        outcomes.append(ConditionOutcome(condition, met, evidence))
    return ShipVerdict(rule, tuple(outcomes))
