"""The hub as the prefetch sees it: where it is and how to talk to it (HubAccess), what a repo
request names (RepoLike), and what a revision lists of each file (HubFile): its size, git oid and
LFS sha256, the digest its bytes must have and the name huggingface_hub gives its blob."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from sparkdeploy.errors import PrefetchError
from sparkdeploy.remote import blobfetch

PUBLIC_HUB = "https://huggingface.co"
TOKEN_SECRET_BLOCK = "hf-token"
# Where a token can come from, as the operator sets it (tasks.prefetch reads them in this order).
TOKEN_SOURCES = f"the Prefect Secret block '{TOKEN_SECRET_BLOCK}' or HF_TOKEN"

Verification = Literal["sha256", "git-sha1"]


class RepoLike(Protocol):
    """Anything naming a repo and an optional revision (plan.RepoRef, RepoSpec)."""

    @property
    def repo(self) -> str: ...

    @property
    def revision(self) -> str | None: ...


@dataclass(frozen=True)
class RepoSpec:
    repo: str
    revision: str | None = None


@dataclass(frozen=True)
class HubAccess:
    """Where the hub is and how to talk to it. The token stays out of repr, so out of logs;
    token_source says where it came from, for the errors that are about it."""

    endpoint: str = field(default_factory=lambda: os.environ.get("HF_ENDPOINT") or PUBLIC_HUB)
    token: str | None = field(default=None, repr=False)
    token_source: str = TOKEN_SOURCES
    max_workers: int = 8
    # Bounds the revision lookup, and each connect and read of a download (not the whole file).
    request_timeout_s: float = 60.0
    # Tries per file for a transient failure (reset, timeout, cut, 5xx), each resuming where
    # the last one stopped, the waits doubling from retry_backoff_s.
    download_attempts: int = 5
    retry_backoff_s: float = 1.0
    # The longest wait a Retry-After (429 rate limit, 503) gets in place; a longer one fails the
    # call as transient, for the task's own retry. The hub's rate-limit window is 5 minutes.
    max_retry_after_s: float = 300.0
    # The token crosses a plain-http endpoint in clear text only when the inventory says so
    # ([hub].allow_http_token: a lab hub, a mirror on a trusted segment).
    allow_http_token: bool = False


def check_token_transport(hub: HubAccess) -> None:
    """Refuse to send a token to a plain-http hub that the inventory does not allow it for."""
    if hub.token and hub.endpoint.lower().startswith("http://") and not hub.allow_http_token:
        raise PrefetchError(
            f"the hub at {hub.endpoint} is plain http and a token is set ({hub.token_source}):"
            " it would cross the network in clear text, so nothing was asked of the hub. Use an"
            " https endpoint, unset the token for a public repo, or, for a hub on a trusted"
            " network, set [hub].allow_http_token = true in the cluster inventory"
        )


@dataclass(frozen=True)
class HubFile:
    """One file of a revision as the hub lists it."""

    path: str
    size: int
    blob_id: str
    lfs_sha256: str | None

    @property
    def verification(self) -> Verification:
        return "sha256" if self.lfs_sha256 is not None else "git-sha1"

    @property
    def expected_digest(self) -> str:
        return self.lfs_sha256 if self.lfs_sha256 is not None else self.blob_id

    @property
    def blob_name(self) -> str:
        """Its name under blobs/, as huggingface_hub names it: the ETag the hub serves it with."""
        return self.expected_digest

    def new_digest(self) -> Any:
        """A hashlib object that, fed the file's bytes, gives expected_digest if they are right."""
        if self.lfs_sha256 is not None:
            return hashlib.sha256()
        return blobfetch.new_digest("sha1", _git_blob_header(self.size))()


def _git_blob_header(size: int) -> bytes:
    return b"blob %d\0" % size
