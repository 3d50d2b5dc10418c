"""What differs between two recipes as the engine will see it: `sparkdeploy diff A B`.

Each recipe is reduced to what reaches its containers (sparkdeploy.spec.plan): the image and the
entrypoint, the model, the `vllm serve` flags with those the plan adds (parallel sizes, backend,
revision), the env, the mounts, the placement. Flags are compared as vLLM reads them
(`--max_num_seqs 8`, `--max-num-seqs=8` and `--max-num-seqs 8` are one flag; JSON values
compact; `--no-x` is `--x` false). A secret shows as `***`: whether it differs is said, never
its value.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from sparkdeploy.report.markdown import markdown_table
from sparkdeploy.secrecy import MASK
from sparkdeploy.spec.container import serve_argv
from sparkdeploy.spec.recipe import Recipe
from sparkdeploy.vllm.args import canonical_flag, is_flag

ABSENT = "(not set)"
SECTIONS = ("image", "model", "args", "env", "mounts", "placement")


def engine_flags(argv: list[str]) -> dict[str, str]:
    """`--flag value` pairs of a serve argv (the model, its first item, left out), by vLLM's
    canonical name; a flag without value is "true", its `--no-` form "false"."""
    flags: dict[str, str] = {}
    index = 1
    while index < len(argv):
        token = argv[index]
        index += 1
        if not is_flag(token):
            continue
        name, has_equals, value = token.partition("=")
        name = canonical_flag(name)
        if not has_equals:
            if index < len(argv) and not is_flag(argv[index]):
                value = argv[index]
                index += 1
            elif name.startswith("--no-"):
                name, value = "--" + name[len("--no-") :], "false"
            else:
                value = "true"
        flags[name] = value
    return flags


def engine_view(recipe: Recipe) -> dict[str, dict[str, str]]:
    """The recipe as its containers will see it, section by section; secrets as `***`."""
    # The plan passes a secret flag (--api-key, --hf-token) as its env variable (secrecy.py).
    env = {**recipe.env, **recipe.secret_flag_env}
    mounts = {
        mount.container: f"{mount.host} ({'ro' if mount.read_only else 'rw'})"
        for mount in recipe.extra_mounts
    }
    if recipe.composed_model is not None:
        sources = ", ".join(
            f"{source.repo}@{source.revision or 'main'}" for source in recipe.composed_model.sources
        )
        mounts[recipe.composed_model.mount] = f"composed model of {sources} (ro)"
    return {
        "image": {
            "docker_image": recipe.docker_image,
            "docker_image_dir": recipe.docker_image_dir or ABSENT,
            "entrypoint": shlex.join(recipe.entrypoint) if recipe.entrypoint else ABSENT,
        },
        "model": {"model": f"{recipe.model}@{recipe.model_revision or 'main'}"},
        "args": engine_flags(serve_argv(recipe)),
        "env": env,
        "mounts": mounts,
        "placement": {
            "required_nodes": str(recipe.required_nodes),
            "shm_size": recipe.shm_size or ABSENT,
            "nccl_profile": recipe.nccl_profile or ABSENT,
        },
    }


@dataclass(frozen=True)
class Difference:
    section: str
    key: str
    a: str  # ABSENT when the first recipe does not set it
    b: str


@dataclass(frozen=True)
class RecipeDiff:
    a: str  # what the recipes were called
    b: str
    differences: tuple[Difference, ...]

    @property
    def same(self) -> bool:
        return not self.differences

    def text(self) -> str:
        lines = [f"--- {self.a}", f"+++ {self.b}"]
        if self.same:
            return "\n".join([*lines, "no difference the engine would see"])
        for section in SECTIONS:
            found = [d for d in self.differences if d.section == section]
            if found:
                lines.append(f"{section}:")
                lines += [f"  {d.key}: {d.a} -> {d.b}" for d in found]
        return "\n".join(lines)

    def markdown(self) -> str:
        if self.same:
            return f"`{self.a}` and `{self.b}`: no difference the engine would see."
        rows = [[d.section, f"`{d.key}`", d.a, d.b] for d in self.differences]
        return "\n".join(markdown_table(["", "", self.a, self.b], rows))


def diff_recipes(a: Recipe, b: Recipe, *, a_name: str = "", b_name: str = "") -> RecipeDiff:
    view_a, view_b = engine_view(a), engine_view(b)
    differences = []
    for section in SECTIONS:
        left, right = view_a[section], view_b[section]
        for key in [*left, *(key for key in right if key not in left)]:
            value_a, value_b = left.get(key, ABSENT), right.get(key, ABSENT)
            if value_a == value_b:
                continue
            if section == "env" and (a.is_secret_env(key) or b.is_secret_env(key)):
                value_a = MASK if key in left else ABSENT
                value_b = (MASK + " (differs)") if key in right else ABSENT
            differences.append(Difference(section, key, value_a, value_b))
    return RecipeDiff(a_name or a.recipe_id, b_name or b.recipe_id, tuple(differences))
