"""Prefetch of hub repos into the NAS HF cache: fetched and verified once, recognised instantly.

huggingface_hub answers what a revision is: its commit sha and its files with size, git oid and
LFS sha256. The bytes go into the cache layout huggingface_hub itself writes and reads offline.
Around that the step adds what a shared NAS cache needs: a free-space check before anything is
fetched, a per-repo lock so two flows never download the same repo at once, a sha256 (LFS) or
git-oid (small files) check of every file once, and a manifest per commit that recognises a
complete repo with one stat per file. The hub's refusals are named with what to do; a rate limit
is waited out as its Retry-After says (docs/field.md, "The Hugging Face hub").

One module per job:
  complete.py    the step: prefetch(), every repo made complete in its order
  hub.py         HubAccess (endpoint, token, timeouts, retries), RepoSpec, a listed file (HubFile)
  revision.py    a revision's commit and files, from one hub call
  names.py       the hub's names (files, shas) and the recipe's revision checked as safe paths
  hub_errors.py  the hub's refusals as errors that name the fix
  cache.py       the HF cache layout, the manifest, the free-space check
  verify.py      every file checked once against the hub's digests
  lock.py        the per-repo NAS lock
  download.py    the missing files fetched over several connections, resumable
  progress.py    the observer's messages and the byte meter
"""

from sparkdeploy.steps.prefetch.cache import FileOutcome, RepoOutcome
from sparkdeploy.steps.prefetch.complete import prefetch
from sparkdeploy.steps.prefetch.hub import (
    PUBLIC_HUB,
    TOKEN_SECRET_BLOCK,
    HubAccess,
    RepoLike,
    RepoSpec,
)
from sparkdeploy.steps.prefetch.progress import PrefetchObserver, Progress

__all__ = [
    "PUBLIC_HUB",
    "TOKEN_SECRET_BLOCK",
    "FileOutcome",
    "HubAccess",
    "PrefetchObserver",
    "Progress",
    "RepoLike",
    "RepoOutcome",
    "RepoSpec",
    "prefetch",
]
