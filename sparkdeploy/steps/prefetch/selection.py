"""Which of a revision's files the prefetch puts into the NAS: by default what an engine reads.

vLLM reads a model directory's top level: its config and tokenizer files (`*.json`, tokenizer
models `*.model`/`*.tiktoken`, `merges.txt`/`vocab.txt`), chat templates (`*.jinja`), custom
code for `--trust-remote-code` (`*.py`), and the weights, `*.safetensors` when there are any, else
`*.bin`/`*.pt`/`*.pth` (vllm/model_executor/model_loader/default_loader.py,
`_prepare_weights`: the first of its patterns that matches wins, safetensors first). A repo that
grew copies of its weights in other layouts (`original/`, `metal/`, GGUF files) costs nothing
more. A recipe adds paths with `[prefetch] include` and drops some with `exclude` (fnmatch
patterns on the path in the repo, `original/*`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from sparkdeploy.steps.prefetch.hub import HubFile

ENGINE_FILES = ("*.safetensors", "*.json", "*.jinja", "*.model", "*.tiktoken", "*.txt", "*.py")
# Weights in the older formats count only where a repo has no safetensors at its top level.
FALLBACK_WEIGHTS = ("*.bin", "*.pt", "*.pth")
SELECTION_VERSION = 1


@dataclass(frozen=True)
class FileSelection:
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def select(self, files: Sequence[HubFile]) -> list[HubFile]:
        """The files to fetch, in the listing's order."""
        top = [f for f in files if "/" not in f.path]
        has_safetensors = any(f.path.endswith(".safetensors") for f in top)
        patterns = ENGINE_FILES if has_safetensors else ENGINE_FILES + FALLBACK_WEIGHTS
        return [
            f
            for f in files
            if (
                ("/" not in f.path and _matches(f.path, patterns)) or _matches(f.path, self.include)
            )
            and not _matches(f.path, self.exclude)
        ]

    def as_json(self) -> dict[str, Any]:
        """What a manifest records: a repo fetched under another selection is not complete."""
        return {
            "version": SELECTION_VERSION,
            "include": list(self.include),
            "exclude": list(self.exclude),
        }


# What every recipe without a [prefetch] table takes.
ENGINE_SELECTION = FileSelection()


def _matches(path: str, patterns: Sequence[str]) -> bool:
    return any(fnmatchcase(path, pattern) for pattern in patterns)
