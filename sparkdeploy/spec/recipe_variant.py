"""A recipe with some of its flags, env, image or checkpoint overridden, written out as a recipe of
its own.

A compare's side may be "recipe X with --max-num-seqs 4" (sparkdeploy.steps.compare.CompareSide),
or recipe X serving another checkpoint: another model repo or another revision of its own
(`swapped_checkpoint`; a composed source that is the model follows it, so the prefetch fetches,
and the composed cache links, the new checkpoint).
The variant is a real recipe file, `<variants dir>/<X>.<hash>/recipe.toml` on the flow host
(sparkdeploy.spec.project.variants_dir), so every step deploys, plans, tears down and shows it like
any recipe, and it is loaded (every check of sparkdeploy.spec.recipe_loading run) before anything
is deployed. Its name is X's with a hash of the overrides: the same overrides give the same file
(written again only when its text changes), a deployment id of its own, and a name a container
label can carry. It holds what the recipe holds, secrets too, so it is readable by its owner
alone (0600) and stays off the NAS. A side may also be a recipe as a git revision of the project
holds it (recipe_at_revision): that file, verbatim, as `<X>.<commit>`, overrides applied on top.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sparkdeploy.errors import CompareError, RecipeError
from sparkdeploy.spec.recipe import Recipe
from sparkdeploy.spec.recipe_loading import load_recipe, recipe_id_for
from sparkdeploy.vllm.args import VllmArgs, canonical_flag, parse_args


def toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, but for DEL, which TOML escapes too."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_value(value: Any) -> str:
    """A value as TOML, tables inline (a recipe's values are strings, numbers, booleans, lists
    and tables of those)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        items = ", ".join(f"{toml_string(str(k))} = {toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    raise TypeError(f"no TOML form for {value!r}")


def recipe_toml(recipe: Recipe, header: Sequence[str]) -> str:
    """The recipe as a file that loads back into an equal recipe; `header` as comment lines."""
    data = recipe.model_dump(exclude_defaults=True)
    if recipe.blocked_reason is not None:
        data["blocked"] = recipe.blocked_reason  # a reason in the header comment is kept too
    lines = [f"# {line}" for line in header]
    lines += [f"{key} = {toml_value(value)}" for key, value in data.items()]
    return "\n".join(lines) + "\n"


def _override_flags(args: Sequence[str], what: str) -> VllmArgs:
    flags, problems = parse_args(args, where=lambda index: f"{what}[{index}]")
    if problems:
        raise CompareError("\n".join(problems))
    return flags


def _negation(canonical: str) -> str:
    """`--no-x` for `--x` and `--x` for `--no-x`: vLLM's two spellings of one boolean."""
    if canonical.startswith("--no-"):
        return "--" + canonical[len("--no-") :]
    return "--no-" + canonical[len("--") :]


def overridden_args(
    recipe: Recipe, args: Sequence[str], drop: Sequence[str], *, what: str
) -> list[str]:
    """The recipe's args with each flag of `args` replacing the recipe's own (or added at the
    end) and the flags named in `drop` left out. `what` names the side in errors."""
    overrides = _override_flags(args, f"{what} args")
    present = {flag.canonical for flag in recipe.vllm_args.flags}
    unknown = [name for name in drop if canonical_flag(name) not in present]
    if unknown:
        raise CompareError(
            f"{what} drop_args: {', '.join(unknown)} not in recipe {recipe.recipe_id}'s args "
            f"({', '.join(sorted(present)) or 'none'}); drop only flags the recipe sets"
        )
    replaced = {canonical_flag(name) for name in drop}
    for flag in overrides.flags:
        replaced |= {flag.canonical, _negation(flag.canonical)}
    kept = [flag for flag in recipe.vllm_args.flags if flag.canonical not in replaced]
    return [*VllmArgs(tuple(kept)).argv(), *overrides.argv()]


def variant_name(recipe_id: str, overrides: Mapping[str, Any]) -> str:
    """`<recipe>.<8 hex>`: a recipe directory name (at most 40 characters, as a deployment id's
    recipe part) naming these overrides of this recipe."""
    digest = hashlib.sha256(
        json.dumps([recipe_id, overrides], sort_keys=True).encode()
    ).hexdigest()[:8]
    return f"{recipe_id[:31]}.{digest}"


def swapped_checkpoint(
    recipe: Recipe, model: str | None, model_revision: str | None
) -> dict[str, Any]:
    """The recipe's fields that name its checkpoint, with another one in its place: `model`
    another repo (at `model_revision`, else its default branch: the recipe's pin is a commit of
    the old repo), or `model_revision` alone the recipe's model at another revision. A composed
    source that is the recipe's model becomes the new checkpoint too (the engine reads the
    composed cache, not `model`); the parent model stays what it is."""
    if model is None and model_revision is None:
        return {}
    repo = model or recipe.model
    revision = model_revision
    if revision is None and repo == recipe.model:
        revision = recipe.model_revision
    update: dict[str, Any] = {"model": repo, "model_revision": revision}
    composed = recipe.composed_model
    if composed is not None:
        sources = [
            source.model_copy(update={"repo": repo, "revision": revision})
            if source.repo == recipe.model
            else source
            for source in composed.sources
        ]
        update["composed_model"] = composed.model_copy(update={"sources": sources})
    return update


def write_variant(
    recipe: Recipe,
    directory: Path,
    *,
    args: Sequence[str] = (),
    drop_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    docker_image: str | None = None,
    model: str | None = None,
    model_revision: str | None = None,
    what: str = "variant",
) -> Path:
    """The overridden recipe's file, written (if its text changed) and loaded back; a recipe
    the overrides make invalid raises CompareError with every problem."""
    overrides: dict[str, Any] = {
        "args": list(args),
        "drop_args": list(drop_args),
        "env": dict(env or {}),
        "docker_image": docker_image,
    }
    if model is not None or model_revision is not None:
        # Only then: the overrides of a variant without a checkpoint keep the name they had.
        overrides |= {"model": model, "model_revision": model_revision}
    update: dict[str, Any] = {
        "args": overridden_args(recipe, args, drop_args, what=what),
        "env": {**recipe.env, **(env or {})},
        **swapped_checkpoint(recipe, model, model_revision),
    }
    if docker_image is not None:
        update["docker_image"] = docker_image
    variant = recipe.model_copy(update=update)
    name = variant_name(recipe.recipe_id, overrides)
    shown = {key: value for key, value in overrides.items() if value}
    shown["env"] = {
        key: ("***" if recipe.is_secret_env(key) else value) for key, value in (env or {}).items()
    }
    text = recipe_toml(
        variant,
        [
            f"Written by the compare flow: recipe {recipe.recipe_id} with {json.dumps(shown)}.",
            "Generated: edit the recipe or the compare's parameters, not this file.",
        ],
    )
    path = directory / name / "recipe.toml"
    _write_private(path, text, what=what)
    try:
        load_recipe(path)
    except RecipeError as error:
        raise CompareError(
            f"{what}: the overrides {json.dumps(shown)} make recipe {recipe.recipe_id} invalid:"
            f"\n{error}"
        ) from None
    return path


def recipe_at_revision(path: Path, revision: str, directory: Path, *, what: str) -> Path:
    """The recipe file at `path` as a git revision of the project (a commit, tag or branch)
    holds it, written verbatim under `directory` as `<name>.<commit>` and loaded back; a revision
    that is not a commit, or whose tree has no such recipe, raises CompareError with the fix."""
    top = _git(path.parent, ["rev-parse", "--show-toplevel"], what=what)
    if top is None:
        raise CompareError(
            f"{what}: revision {revision!r} asked, but {path.parent} is not in a git checkout; "
            "run the flow from a clone of the project, or compare recipes by name or path"
        )
    inside = path.resolve().relative_to(Path(top).resolve()).as_posix()
    commit = _git(
        Path(top),
        ["rev-parse", "--verify", "--quiet", "--end-of-options", f"{revision}^{{commit}}"],
        what=what,
    )
    if commit is None:
        raise CompareError(
            f"{what}: {revision!r} is not a commit, tag or branch of the project's git repository "
            f"{top}; `git log --oneline -- {inside}` lists the recipe's commits"
        )
    text = _git(Path(top), ["show", f"{commit}:{inside}"], what=what)
    if text is None:
        raise CompareError(
            f"{what}: {inside} does not exist at {revision} ({commit[:12]}); "
            f"`git log --oneline -- {inside}` lists the commits that have it"
        )
    header = f"# Written by the compare flow: {inside} as committed at {commit} ({revision}).\n"
    written = directory / f"{recipe_id_for(path)[:31]}.{commit[:8]}" / "recipe.toml"
    _write_private(written, header + text + ("" if text.endswith("\n") else "\n"), what=what)
    try:
        load_recipe(written)
    except RecipeError as error:
        raise CompareError(
            f"{what}: {inside} at {revision} ({commit[:12]}) is not a valid recipe today:\n{error}"
        ) from None
    return written


def _git(cwd: Path, argv: Sequence[str], *, what: str) -> str | None:
    """git's stdout, None when it refuses (not a repository, no such revision or file)."""
    try:
        completed = subprocess.run(
            ["git", "-C", str(cwd), *argv], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise CompareError(f"{what}: cannot run git to read a recipe revision: {error}") from None
    return completed.stdout.strip("\n") if completed.returncode == 0 else None


def _write_private(path: Path, text: str, *, what: str) -> None:
    """`text` at `path`, readable by its owner alone, written only when it changed."""
    try:
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            partial = path.with_name(".recipe.toml.partial")
            partial.touch(mode=0o600)
            partial.write_text(text)
            partial.replace(path)
    except OSError as error:
        raise CompareError(
            f"{what}: cannot write the variant recipe {path}: {error}; set "
            f"SPARKDEPLOY_VARIANTS_DIR to a writable directory of the flow host"
        ) from error
