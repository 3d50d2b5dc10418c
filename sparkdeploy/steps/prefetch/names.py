"""What a hub says becomes paths in the NAS cache only once it has the form a hub's names have.

The cache's paths are built from the hub's answer: `snapshots/<commit sha>/<file name>`,
`blobs/<git oid or LFS sha256>`, and from the recipe: `refs/<revision>`. A name with a `..`
component, an absolute name or a sha that is not hex would put a file anywhere the flow host can
write. huggingface_hub guards its own paths the same way (file_download.py, `_get_pointer_path`:
"Invalid pointer path: cannot create pointer path in snapshot folder"); ours are checked before
the first byte is written, and a revision with one bad entry is refused whole.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from sparkdeploy.errors import PrefetchError
from sparkdeploy.node.hfcache import relative_path_problem
from sparkdeploy.steps.prefetch.hub import HubAccess, HubFile, RepoLike

# huggingface_hub's own form of a commit hash (constants.py, REGEX_COMMIT_HASH) and of a git
# blob id; an LFS object id is a sha256.
_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
_GIT_OID = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def is_commit_sha(value: str) -> bool:
    return _COMMIT_SHA.fullmatch(value) is not None


def check_revision_name(ref: RepoLike) -> None:
    """A recipe's revision names a file under refs/ (a branch or tag, `refs/pr/1`) or a commit."""
    if ref.revision is None:
        return
    problem = relative_path_problem(ref.revision)
    if problem is not None:
        raise PrefetchError(
            f"{ref.repo}: revision {ref.revision!r} {problem}: refused (it would name a path"
            " outside the NAS cache's refs/); give a branch, tag or commit sha in the recipe"
        )


def check_listing(ref: RepoLike, hub: HubAccess, sha: str, files: Sequence[HubFile]) -> None:
    """Every name the hub gave for `ref` is safe to put in a path, else the revision is refused
    naming the first entry that is not."""
    where = f"{ref.repo}@{ref.revision or 'main'}"
    problems: list[tuple[str, str, str]] = []
    if not is_commit_sha(sha):
        problems.append(("commit sha", sha, "is not 40 lowercase hex digits"))
    for f in files:
        if (problem := relative_path_problem(f.path)) is not None:
            problems.append(("file name", f.path, problem))
        if _GIT_OID.fullmatch(f.blob_id) is None:
            problems.append(("blob id", f.blob_id, f"(of {f.path!r}) is not a 40-hex git oid"))
        if f.lfs_sha256 is not None and _SHA256.fullmatch(f.lfs_sha256) is None:
            problems.append(("sha256", f.lfs_sha256, f"(of {f.path!r}) is not 64 hex digits"))
    if problems:
        what, value, problem = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PrefetchError(
            f"{where}: the hub at {hub.endpoint} listed {what} {value!r}, which {problem}{more}:"
            " the revision is refused and nothing of it was written. A hub's names never leave"
            " the NAS cache; check that HF_ENDPOINT or the inventory's [hub].endpoint is a"
            " Hugging Face hub you trust"
        )
