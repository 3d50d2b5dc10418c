"""The A/B comparison: two sides deployed, smoke-tested, quality-gated, benchmarked, torn down,
side by side.

A side is a recipe, or a recipe with flags, env, image or checkpoint (model repo or revision)
overridden (written out as a variant recipe: sparkdeploy.spec.recipe_variant; a swapped
checkpoint is asked of the hub before anything is deployed: `checkpoint_problems`). The sides run
one after the other on shared nodes (A torn down before B deploys) or at once on disjoint nodes
(`place_sides`). The result is one table (sparkdeploy.steps.compare_outcome): every smoke check,
each eval's score, every benchmark figure at every level and context depth, the boot's phases and
the figures the head's log gave, each with B's difference from A and a verdict: better, worse, or
same within noise. A figure of the benchmark, or an eval's score, is the median of its repeated
runs; B/A counts when it is beyond both sides' spreads (half the range of their runs, as ratios)
and beyond a floor (`NoiseRule.verdict`: the rules are sparkdeploy.report.verdicts). A boot
happens once per side, so its figures get a fixed tolerance instead, which the table states. A
ship rule ("quality>=88, decode@8192 not worse": sparkdeploy.report.ship_rule) is judged on the
table. A side that fails (deploy, boot, smoke, benchmark) is shown failed with its cause; the
other side's figures are still there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sparkdeploy.errors import CompareError
from sparkdeploy.report import chart
from sparkdeploy.report.benchmark_figures import chart_panels
from sparkdeploy.report.benchmark_tables import comparison_table
from sparkdeploy.report.markdown import markdown_table
from sparkdeploy.report.recipe_diff import RecipeDiff, diff_recipes
from sparkdeploy.report.ship_rule import ShipRule, ShipVerdict, judge_rule, parse_ship_rule
from sparkdeploy.report.verdicts import NoiseRule, Row
from sparkdeploy.secrecy import MASK
from sparkdeploy.spec.cluster import Cluster
from sparkdeploy.spec.plan import make_plan
from sparkdeploy.spec.project import find_recipe
from sparkdeploy.spec.recipe import Recipe, RepoRef
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.spec.recipe_variant import recipe_at_revision, write_variant
from sparkdeploy.steps.compare_outcome import SideOutcome, judge_subject, side_rows
from sparkdeploy.steps.prefetch import HubAccess
from sparkdeploy.steps.prefetch.preview import preview_repos

Placement = Literal["auto", "sequential", "at_once"]


class CompareSide(BaseModel):
    """One side of a comparison (the Prefect UI's form shows these descriptions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    recipe: str = Field(description="A recipe name under recipes/ (or a path to one).")
    revision: str | None = Field(
        default=None,
        description="A git commit, tag or branch of the project: the recipe as committed there "
        "(default: the recipe as it is now), e.g. the side before a change.",
    )
    args: list[str] = Field(
        default=[],
        description="vLLM flags that replace the recipe's own or are added, as an argv: "
        '["--max-num-seqs", "4", "--enable-prefix-caching"]. A --no-x replaces --x.',
    )
    drop_args: list[str] = Field(
        default=[], description='Flags of the recipe left out, e.g. ["--enforce-eager"].'
    )
    env: dict[str, str] = Field(
        default={}, description="Environment variables set over the recipe's [env]."
    )
    docker_image: str | None = Field(
        default=None, description="Another image for the recipe (a rebuilt one, a new tag)."
    )
    model: str | None = Field(
        default=None,
        description="Another checkpoint: a Hugging Face repo (org/name) served in the recipe's "
        "model's place (a composed source that is the model too); prefetched like any.",
    )
    model_revision: str | None = Field(
        default=None,
        description="The checkpoint's revision (a commit sha is best, or a branch or tag): of "
        "`model`, or alone of the recipe's own model.",
    )
    nodes: list[str] | None = Field(
        default=None,
        description="The side's nodes in rank order (default: chosen by placement).",
    )

    @property
    def swaps_checkpoint(self) -> bool:
        return self.model is not None or self.model_revision is not None

    @property
    def has_overrides(self) -> bool:
        return bool(
            self.args or self.drop_args or self.env or self.docker_image or self.swaps_checkpoint
        )

    def describe(self, recipe: Recipe) -> str:
        """The recipe and the overrides, for people; a secret env value as ***."""
        parts = []
        if self.args:
            parts.append("args " + " ".join(self.args))
        if self.drop_args:
            parts.append("without " + " ".join(self.drop_args))
        if self.env:
            shown = (
                f"{key}={MASK if recipe.is_secret_env(key) else value}"
                for key, value in self.env.items()
            )
            parts.append("env " + " ".join(shown))
        if self.docker_image:
            parts.append(f"image {self.docker_image}")
        if self.swaps_checkpoint:
            parts.append(f"model {self.model or recipe.model}@{self.model_revision or 'main'}")
        at = f" at {self.revision}" if self.revision else ""
        return self.recipe + at + (f" with {'; '.join(parts)}" if parts else "")


@dataclass(frozen=True)
class PreparedSide:
    label: str  # "A" or "B"
    recipe: str  # what the deploy flow takes: the recipe's name, or the variant's path
    recipe_id: str
    description: str
    nodes: list[str]
    deployment_id: str
    checkpoint: RepoRef | None = None  # the checkpoint the side swapped in, if it swapped one
    evals: tuple[str, ...] = ()  # its recipe's [quality] evals, run after its smoke test


@dataclass(frozen=True)
class PreparedComparison:
    a: PreparedSide
    b: PreparedSide
    at_once: bool
    placement: str  # how the sides are placed, in words
    diff: RecipeDiff
    ship_rule: ShipRule | None = None

    @property
    def sides(self) -> tuple[PreparedSide, PreparedSide]:
        return self.a, self.b


def checked_ship_rule(text: str, evals_b: Sequence[str]) -> ShipRule:
    """The rule parsed, its evals checked against those side B's recipe runs."""
    rule = parse_ship_rule(text)
    for name in rule.evals:
        if name == "quality" and len(evals_b) != 1:
            raise CompareError(
                f"ship_if: `quality` names side B's only eval, but its recipe's [quality] has "
                f"{', '.join(evals_b) if evals_b else 'none'}: name the eval"
            )
        if name != "quality" and name not in evals_b:
            raise CompareError(
                f"ship_if names the eval {name!r}, which side B's recipe does not run (its "
                f"[quality] evals: {', '.join(evals_b) or 'none'}; docs/quality.md)"
            )
    return rule


def place_sides(
    cluster: Cluster,
    required: tuple[int, int],
    given: tuple[list[str] | None, list[str] | None],
    placement: Placement,
) -> tuple[list[str], list[str], bool, str]:
    """The sides' nodes and whether they run at once: on disjoint nodes when asked to
    (`at_once`) or when the cluster has room (`auto`), else one after the other on the
    first nodes."""
    names = [node.name for node in cluster.nodes]

    def first_free(count: int, taken: Sequence[str]) -> list[str] | None:
        free = [name for name in names if name not in taken]
        return free[:count] if len(free) >= count else None

    if placement != "sequential":
        nodes_a = given[0] or first_free(required[0], given[1] or [])
        nodes_b = given[1] or (first_free(required[1], nodes_a) if nodes_a else None)
        if nodes_a and nodes_b and not set(nodes_a) & set(nodes_b):
            return nodes_a, nodes_b, True, "at once on disjoint nodes"
        if placement == "at_once":
            raise CompareError(
                f"the sides cannot run at once on cluster {cluster.name}: they need "
                f"{required[0]} + {required[1]} nodes"
                + (
                    f" and share {', '.join(sorted(set(nodes_a) & set(nodes_b)))}"
                    if nodes_a and nodes_b
                    else f", the cluster has {len(names)}"
                )
                + '; name disjoint nodes for each side or use placement "sequential"'
            )
    nodes_a = given[0] or names[: required[0]]
    nodes_b = given[1] or names[: required[1]]
    return nodes_a, nodes_b, False, "one after the other (A torn down before B deploys)"


def prepare(
    side_a: CompareSide,
    side_b: CompareSide,
    cluster: Cluster,
    placement: Placement,
    *,
    variants: Path,
    root: Path | None = None,
    ship_if: str | None = None,
) -> PreparedComparison:
    """Both sides' recipes loaded (variants written and checked), their nodes placed and
    planned, the ship rule read: every input problem is found here, before anything is
    deployed."""
    loaded = []
    for label, side in (("A", side_a), ("B", side_b)):
        what = f"side {label}"
        path = find_recipe(side.recipe, root)
        argument = side.recipe
        if side.revision:
            path = recipe_at_revision(path, side.revision, variants, what=what)
            argument = str(path.parent)
        base = load_recipe(path)
        recipe = base
        if side.has_overrides:
            path = write_variant(
                base,
                variants,
                args=side.args,
                drop_args=side.drop_args,
                env=side.env,
                docker_image=side.docker_image,
                model=side.model,
                model_revision=side.model_revision,
                what=what,
            )
            argument, recipe = str(path.parent), load_recipe(path)
        loaded.append((label, side, argument, recipe, side.describe(base)))
    (_, _, _, recipe_a, _), (_, _, _, recipe_b, _) = loaded
    nodes_a, nodes_b, at_once, how = place_sides(
        cluster,
        (recipe_a.required_nodes, recipe_b.required_nodes),
        (side_a.nodes, side_b.nodes),
        placement,
    )
    a, b = (
        PreparedSide(
            label,
            argument,
            recipe.recipe_id,
            description,
            nodes,
            make_plan(recipe, cluster, nodes).deployment_id,
            RepoRef(repo=recipe.model, revision=recipe.model_revision)
            if side.swaps_checkpoint
            else None,
            tuple(recipe.quality.eval_names) if recipe.quality else (),
        )
        for (label, side, argument, recipe, description), nodes in zip(
            loaded, (nodes_a, nodes_b), strict=True
        )
    )
    diff = diff_recipes(
        recipe_a, recipe_b, a_name=f"A: {a.description}", b_name=f"B: {b.description}"
    )
    rule = checked_ship_rule(ship_if, b.evals) if ship_if is not None else None
    return PreparedComparison(a, b, at_once, how, diff, rule)


def checkpoint_problems(
    prepared: PreparedComparison, cache_dir: Path, hub: HubAccess
) -> tuple[list[str], list[str]]:
    """The swapped checkpoints asked of the hub (or found in the NAS cache) as the prefetch
    would, before anything is deployed: the refused ones (no such repo or revision, gated, a
    revision no path may name) and those the hub did not answer about (the side's own prefetch
    will ask again)."""
    swapped = [(side.label, side.checkpoint) for side in prepared.sides if side.checkpoint]
    if not swapped:
        return [], []
    previews = preview_repos([ref for _, ref in swapped], cache_dir, hub)
    found = {(preview.repo, preview.revision): preview for preview in previews}
    refused, unknown = [], []
    for label, ref in swapped:
        preview = found[(ref.repo, ref.revision)]
        named = f"side {label}: checkpoint {ref.repo}@{ref.revision or 'main'}"
        if preview.action == "refuse":
            refused.append(f"{named}: {preview.detail}")
        elif preview.action == "unknown":
            unknown.append(f"{named}: {preview.detail}")
    return refused, unknown


@dataclass(frozen=True)
class Comparison:
    prepared: PreparedComparison
    a: SideOutcome
    b: SideOutcome
    rows: tuple[Row, ...]
    noise: NoiseRule = field(default_factory=NoiseRule)
    ship: ShipVerdict | None = None  # the ship rule's verdict, when the compare asked one

    @classmethod
    def of(
        cls, prepared: PreparedComparison, a: SideOutcome, b: SideOutcome, noise: NoiseRule
    ) -> Comparison:
        rows = side_rows(a, b, noise)
        rule = prepared.ship_rule
        ship = None
        if rule is not None:
            ship = judge_rule(rule, lambda subject: judge_subject(subject, a, b, rows))
        return cls(prepared, a, b, tuple(rows), noise, ship)

    def verdicts(self) -> Counter[str]:
        return Counter(row.verdict for row in self.rows)

    def row(self, group: str, figure: str) -> Row:
        return next(row for row in self.rows if row.group == group and row.figure == figure)

    @property
    def failed(self) -> list[SideOutcome]:
        return [side for side in (self.a, self.b) if not side.ok]

    def summary_line(self) -> str:
        counts = self.verdicts()
        judged = ", ".join(f"{counts[v]} {v}" for v in ("better", "worse", "same") if counts[v])
        failed = "; ".join(f"side {side.label} {side.state_text()}" for side in self.failed)
        ship = f"{self.ship.headline()}. " if self.ship else ""
        return (
            ship + f"B against A: {judged or 'nothing judged'}" + (f". {failed}" if failed else "")
        )

    def markdown(self, links: Mapping[str, str] | None = None) -> str:
        links = links or {}
        prepared = self.prepared
        title = f"# Compare A: {prepared.a.description} with B: {prepared.b.description}"
        sides = [
            ["recipe", f"`{prepared.a.recipe_id}`", f"`{prepared.b.recipe_id}`"],
            ["nodes", ", ".join(prepared.a.nodes), ", ".join(prepared.b.nodes)],
            ["deployment", f"`{prepared.a.deployment_id}`", f"`{prepared.b.deployment_id}`"],
            ["run", *(self._link(side, links) for side in (self.a, self.b))],
            ["outcome", self.a.state_text(), self.b.state_text()],
        ]
        lines = [
            title,
            "",
            "## What differs, as the engine sees it",
            "",
            prepared.diff.markdown(),
            "",
            f"Placement: {prepared.placement}.",
            "",
            *markdown_table(["", "A", "B"], sides),
        ]
        if self.ship is not None:
            lines += ["", *self.ship.markdown()]
        measured = [
            (f"{side.label}: {side_prepared.description}", side.benchmark)
            for side, side_prepared in ((self.a, prepared.a), (self.b, prepared.b))
            if side.benchmark is not None
        ]
        if measured:
            results = {label: result.figures() for label, result in measured}
            depths = {label: result.depth_figures() for label, result in measured}
            lines += [
                "",
                chart.markdown_image(
                    "throughput and latency against concurrency, decode at depth, A and B",
                    chart.svg(chart_panels(results, depths)),
                ),
            ]
        lines += [
            "",
            f"## Side by side: {self.summary_line()}",
            "",
            *comparison_table(self.rows),
            "",
            f"Noise: {self.noise.text()}",
        ]
        for side in (self.a, self.b):
            if side.benchmark is not None:
                prompt = side.benchmark.prompt
                lines.append(
                    f"- {side.label}: prompts of {prompt.counted} tokens as its engine counts "
                    f"them; {side.benchmark.client_check.text()}."
                )
                notes = side.benchmark.engine_disagreements()
                if side.benchmark.depths_lowered:
                    notes.append(f"depths: {side.benchmark.depths_lowered}")
                lines += [f"- {side.label}: {note}" for note in notes]
        return "\n".join(lines)

    @staticmethod
    def _link(side: SideOutcome, links: Mapping[str, str]) -> str:
        if side.label in links:
            return f"[side {side.label}]({links[side.label]})"
        return side.flow_run_id or "—"
