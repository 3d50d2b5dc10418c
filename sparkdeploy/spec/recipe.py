"""The recipe model (recipes/<name>/recipe.toml) and the facts the pipeline derives from it.

docs/recipes.md documents every key. Loading goes through `load_recipe`
(sparkdeploy.spec.recipe_loading), which reports every problem of a file at once, each as
`file:line: key: what is wrong and what to do`.
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from sparkdeploy.errors import RecipeError
from sparkdeploy.secrecy import API_KEY_ENV, API_KEY_FLAG, FLAG_ENV, is_secret_name
from sparkdeploy.spec.quality import IMAGE_REFERENCE_FORM, Quality, image_reference_problem
from sparkdeploy.vllm.args import VllmArgs, normalise_args

DEFAULT_API_PORT = 8000
# vLLM's own default for VLLM_ENGINE_READY_TIMEOUT_S: it gives up on the engine after this.
DEFAULT_READINESS_TIMEOUT_S = 600.0
READINESS_ENV = "VLLM_ENGINE_READY_TIMEOUT_S"

# huggingface_hub's validate_repo_id: each part starts and ends with a letter, digit or _, a name
# holds at most 96 characters and the id no "--" or ".."; ASCII only.
_REPO_ID = re.compile(r"\w(?:[\w.-]*\w)?/\w(?:[\w.-]{0,94}\w)?", re.ASCII)
_SHM_SIZE = re.compile(r"\d+(\.\d+)?[bkmgt]?b?", re.IGNORECASE | re.ASCII)
# Sizes a cluster could hold; far beyond, a plan lists ranks and nodes by the million.
MAX_PARALLEL_SIZE = 1024


def is_repo_id(repo: str) -> bool:
    """Whether `repo` is a Hugging Face repo id the hub accepts, written as 'org/name'."""
    return _REPO_ID.fullmatch(repo) is not None and "--" not in repo and ".." not in repo


# vLLM's CPU build leaves its platform's ray_device_key empty, so its Ray executor stops at start
# (vllm/v1/executor/ray_utils.py: "current platform cpu does not support ray").
RAY_REFUSAL = (
    "mp is the supported backend. vLLM's multi-node mp executor needs no Ray cluster, and the "
    "lab and CI run it on real vLLM; the Ray path was never run, and vLLM's CPU build cannot run "
    'it ("current platform cpu does not support ray"). Write distributed_backend = "mp" (the '
    'default) and, in args, "--distributed-executor-backend", "mp" (or no such flag: the plan '
    "adds it), and drop any Ray-specific args and env (RAY_*)"
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class RepoRef(_Strict):
    """A Hugging Face repo and the revision to use (None: the default branch)."""

    repo: str
    revision: str | None = None


class MarkerSpec(_Strict):
    """A named regular expression searched for in the engine log."""

    name: str
    pattern: str

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(
                f"not a valid regular expression ({exc}); escape a literal [ ] ( ) . * + ? with "
                "a backslash (in a '...' string TOML keeps backslashes as written)"
            ) from None
        except RecursionError:
            raise ValueError(
                "the regular expression nests its groups too deeply to compile; write it flatter"
            ) from None
        return pattern


class SmokeOptions(_Strict):
    """What the smoke test adds to its chat completion requests."""

    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    max_tokens: int | None = Field(default=None, ge=1)
    request_timeout_s: float | None = Field(default=None, gt=0)


class ComposedSource(_Strict):
    repo: str
    revision: str | None = None


class ComposedLocalFile(_Strict):
    host: str
    # From the ops host (the flow host), relative to the recipe dir; None: the file of the same
    # name in the composed source's snapshot in the NAS cache.
    from_file: str | None = None
    # None: decided by the plan (sparkdeploy.spec.local_files).
    kind: Literal["engram", "plain"] | None = None


class ComposedModel(_Strict):
    mount: str
    sources: list[ComposedSource] = Field(default_factory=list)
    local_files: list[ComposedLocalFile] = Field(default_factory=list)


class PrefetchFiles(_Strict):
    """Paths of the recipe's repos the prefetch takes beyond (include) or out of (exclude) what
    an engine reads (sparkdeploy.steps.prefetch.selection); fnmatch patterns on repo paths."""

    include: list[str] = Field(default_factory=list)
    exclude: list[str] = Field(default_factory=list)


class ExtraMount(_Strict):
    host: str
    container: str
    read_only: bool = False


class Recipe(_Strict):
    """One recipe file. Keys are documented in docs/recipes.md."""

    engine: Literal["vllm"] = "vllm"
    name: str
    blocked: str | None = None
    docker_image: str
    docker_image_dir: str | None = None
    model: str
    model_revision: str | None = None
    parent_model: str | None = None
    parent_model_revision: str | None = None
    required_nodes: int = Field(ge=1)
    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    distributed_backend: Literal["mp"] = "mp"  # "ray" is refused: RAY_REFUSAL
    shm_size: str | None = None
    entrypoint: list[str] | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: list[str] = Field(default_factory=list)  # beyond the names secrecy.py knows
    nccl_profile: str | None = None
    composed_model: ComposedModel | None = None
    extra_mounts: list[ExtraMount] = Field(default_factory=list)
    boot_markers: list[MarkerSpec] = Field(default_factory=list)  # empty: vLLM's own markers
    failure_markers: list[MarkerSpec] = Field(default_factory=list)
    smoke: SmokeOptions = Field(default_factory=SmokeOptions)
    prefetch: PrefetchFiles = Field(default_factory=PrefetchFiles)
    quality: Quality | None = None  # the quality gate's evals (docs/quality.md)

    _recipe_id: str = PrivateAttr(default="recipe")
    _header_blocked_reason: str | None = PrivateAttr(default=None)
    # The recipe file's dir: local_files' from_file paths are relative to it.
    _recipe_dir: Path = PrivateAttr(default=Path("."))

    @field_validator("model", "parent_model")
    @classmethod
    def _is_repo_id(cls, repo: str | None) -> str | None:
        if repo is not None and not is_repo_id(repo):
            raise ValueError(
                f"{repo!r} is not a Hugging Face repo id; write it as 'org/name' (ASCII "
                "letters, digits, _ . -; each part starts and ends with a letter, digit or _; "
                "no '--' or '..')"
            )
        return repo

    @field_validator("required_nodes", "tensor_parallel_size", "pipeline_parallel_size")
    @classmethod
    def _within_a_cluster(cls, size: int) -> int:
        if size > MAX_PARALLEL_SIZE:
            raise ValueError(
                f"{size} is more than {MAX_PARALLEL_SIZE}, beyond any cluster this deploys to; "
                "write the number of nodes or GPUs meant"
            )
        return size

    @field_validator("docker_image")
    @classmethod
    def _is_image_reference(cls, image: str) -> str:
        problem = image_reference_problem(image)
        if problem is not None:
            raise ValueError(f"{image!r} {problem}: {IMAGE_REFERENCE_FORM}")
        return image

    @field_validator("distributed_backend", mode="before")
    @classmethod
    def _not_ray(cls, backend: object) -> object:
        if backend == "ray":
            raise ValueError(f'"ray" is refused: {RAY_REFUSAL}')
        return backend

    @field_validator("shm_size")
    @classmethod
    def _is_size(cls, size: str | None) -> str | None:
        if size is not None and not _SHM_SIZE.fullmatch(size):
            raise ValueError(f'{size!r} is not a size; write it like "32gb" or "512m"')
        return size

    @field_validator("entrypoint")
    @classmethod
    def _not_empty(cls, entrypoint: list[str] | None) -> list[str] | None:
        if entrypoint is not None and not entrypoint:
            raise ValueError("an empty entrypoint runs nothing; remove the key to use the image's")
        return entrypoint

    def set_origin(
        self, recipe_id: str, recipe_dir: Path, header_blocked_reason: str | None
    ) -> None:
        """What only the recipe's file knows: its id, its dir (from_file paths are relative to
        it) and the BLOCKED paragraph of its header comment. Set once, by load_recipe."""
        self._recipe_id = recipe_id
        self._recipe_dir = recipe_dir
        self._header_blocked_reason = header_blocked_reason

    @property
    def recipe_id(self) -> str:
        """The recipe's directory name (what `sparkdeploy plan NAME` takes)."""
        return self._recipe_id

    def ops_file(self, local: ComposedLocalFile) -> Path | None:
        """Where a local file's from_file is on the ops host (None: it comes from the NAS)."""
        return None if local.from_file is None else self._recipe_dir / local.from_file

    @cached_property
    def vllm_args(self) -> VllmArgs:
        return normalise_args(self.args)

    @property
    def served_model_name(self) -> str:
        return self.vllm_args.value("--served-model-name") or self.model

    @property
    def api_port(self) -> int:
        port = self.vllm_args.value("--port")
        return int(port) if port is not None else DEFAULT_API_PORT

    @property
    def api_key(self) -> str | None:
        """The key vLLM guards /v1 with: `--api-key`, else env VLLM_API_KEY."""
        return self.vllm_args.value(API_KEY_FLAG) or self.env.get(API_KEY_ENV) or None

    @property
    def secret_flag_env(self) -> dict[str, str]:
        """The secret flags' values as the env variables vLLM reads in their place (FLAG_ENV):
        the plan passes them so, never in an argv. A bare `--hf-token` (no value) is not here."""
        values = {env: self.vllm_args.value(flag) for flag, env in FLAG_ENV.items()}
        return {env: value for env, value in values.items() if value}

    def is_secret_env(self, name: str) -> bool:
        return is_secret_name(name, self.secret_env)

    @property
    def readiness_timeout_s(self) -> float:
        value = self.env.get(READINESS_ENV)
        return float(value) if value is not None else DEFAULT_READINESS_TIMEOUT_S

    @property
    def blocked_reason(self) -> str | None:
        """Why the recipe must not be deployed, or None when it may be."""
        if self.blocked is not None:
            return self.blocked
        if "[BLOCKED]" in self.name:
            return self._header_blocked_reason or "the recipe's name says [BLOCKED]"
        return None

    @property
    def speculative_model(self) -> str | None:
        """The drafter repo named by --speculative-config's `model`, if it names a repo."""
        flag = self.vllm_args.find("--speculative-config")
        if flag is None or not isinstance(flag.json_value, dict):
            return None
        model = flag.json_value.get("model")
        if isinstance(model, str) and is_repo_id(model):
            return model
        return None

    @property
    def hf_repos(self) -> list[RepoRef]:
        """Every repo the deployment reads, each once; a pinned revision wins over none."""
        wanted = [RepoRef(repo=self.model, revision=self.model_revision)]
        if self.parent_model:
            wanted.append(RepoRef(repo=self.parent_model, revision=self.parent_model_revision))
        if self.composed_model:
            wanted += [
                RepoRef(repo=s.repo, revision=s.revision) for s in self.composed_model.sources
            ]
        if self.speculative_model:
            wanted.append(RepoRef(repo=self.speculative_model))
        by_repo: dict[str, RepoRef] = {}
        for ref in wanted:
            known = by_repo.get(ref.repo)
            if known is None or known.revision is None:
                by_repo[ref.repo] = ref
            elif ref.revision not in (None, known.revision):
                raise RecipeError(
                    f"{ref.repo} is pinned to two revisions "
                    f"({known.revision}, {ref.revision}); pin one"
                )
        return list(by_repo.values())
