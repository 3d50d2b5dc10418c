"""The Hugging Face cache layout, as node scripts read it (standard library only; shipped to nodes).

`models--org--name/refs/<branch or tag>` holds a commit sha; `snapshots/<sha>/` holds the repo's
files (symlinks into `blobs/`). A revision that is itself a full sha names its snapshot directly.
"""

from __future__ import annotations

import os
import re

_FULL_SHA = re.compile(r"[0-9a-f]{40}")


def relative_path_problem(name: str) -> str | None:
    """Why `name` cannot be a path below a directory (None: it can): a hub's file names and a
    recipe's revisions (a file under refs/) are POSIX paths relative to their directory, and one
    with a `..` component or an absolute one would name a path outside the cache."""
    if not name:
        return "is empty"
    if "\0" in name:
        return "holds a NUL byte"
    if name.startswith("/"):
        return "is absolute"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "has an empty, '.' or '..' component"
    return None


class SnapshotNotFound(Exception):
    """The repo or revision is not in the HF cache; the message names the path and the fix."""


def repo_dir(hf_cache: str, repo: str) -> str:
    return os.path.join(hf_cache, "models--" + repo.replace("/", "--"))


def resolve_snapshot(hf_cache: str, repo: str, revision: str | None) -> tuple[str, str]:
    """(commit sha, snapshot dir) of repo@revision (main when None) in the cache at hf_cache."""
    base = repo_dir(hf_cache, repo)
    wanted = revision or "main"
    if _FULL_SHA.fullmatch(wanted):
        sha = wanted
    else:
        ref = os.path.join(base, "refs", wanted)
        try:
            with open(ref, encoding="ascii") as ref_file:
                sha = ref_file.read().strip()
        except FileNotFoundError:
            raise SnapshotNotFound(
                f"{repo}@{wanted} is not in the HF cache {hf_cache}: {ref} does not exist; "
                "run the prefetch step for this repo first"
            ) from None
        if not _FULL_SHA.fullmatch(sha):
            raise SnapshotNotFound(
                f"{ref} holds {sha[:80]!r}, not a commit sha; the cache entry is damaged, "
                "run the prefetch step for this repo again"
            )
    snapshot = os.path.join(base, "snapshots", sha)
    if not os.path.isdir(snapshot):
        raise SnapshotNotFound(
            f"{repo}@{wanted}: snapshot dir {snapshot} does not exist; "
            "run the prefetch step for this repo first"
        )
    return sha, snapshot
