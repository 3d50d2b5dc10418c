"""The hub's refusals as PrefetchErrors that say what to do.

They are named from the hub's X-Error-Code (GatedRepo, RepoNotFound, RevisionNotFound,
EntryNotFound) and never retried; a 429 or 503 is transient, and carries the wait its
Retry-After asks for (docs/field.md, "The Hugging Face hub").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import httpx2
from huggingface_hub.errors import HfHubHTTPError

from sparkdeploy.errors import PrefetchError, TransientPrefetchError
from sparkdeploy.remote import blobfetch
from sparkdeploy.steps.prefetch.hub import TOKEN_SECRET_BLOCK, HubAccess, RepoLike

# The hub's answer to a token that is no token of its own (revoked, mistyped).
_INVALID_TOKEN_MESSAGE = "Invalid credentials in Authorization header"


@dataclass(frozen=True)
class FileDownload:
    """The file download a hub error answered: the file, the commit it is of, the URL asked."""

    path: str
    sha: str
    url: str


@contextlib.contextmanager
def hub_errors(ref: RepoLike, hub: HubAccess) -> Iterator[None]:
    """Turn a failed huggingface_hub call inside the block into the PrefetchError for it."""
    try:
        yield
    except PrefetchError:
        raise
    except Exception as exc:
        mapped = map_hub_error(exc, ref, hub)
        if mapped is None:
            raise
        raise mapped from exc


def map_hub_error(exc: BaseException, ref: RepoLike, hub: HubAccess) -> PrefetchError | None:
    """The PrefetchError for a failed huggingface_hub call, or None if it is not a hub failure."""
    for cause in _cause_chain(exc):
        if isinstance(cause, HfHubHTTPError) and cause.response is not None:
            headers = cause.response.headers
            return status_error(
                cause.response.status_code,
                ref,
                hub,
                error_code=headers.get("X-Error-Code"),
                detail=headers.get("X-Error-Message") or "",
                retry_after_s=blobfetch.retry_after_s(headers),
            )
        if isinstance(cause, httpx2.TransportError):
            return TransientPrefetchError(
                f"cannot reach the hub at {hub.endpoint} for {ref.repo}@{ref.revision or 'main'} "
                f"({type(cause).__name__}: {cause}): check the network and HF_ENDPOINT"
            )
    return None


def status_error(
    status: int,
    ref: RepoLike,
    hub: HubAccess,
    *,
    error_code: str | None = None,
    detail: str = "",
    retry_after_s: float | None = None,
    download: FileDownload | None = None,
) -> PrefetchError:
    """The error for an HTTP status from the hub, named from its X-Error-Code, with the fix.

    `download`: the status answered a file's download (None: the revision's info).
    """
    where = f"{ref.repo}@{ref.revision or 'main'}"
    answer = f"HTTP {status} {error_code}" if error_code else f"HTTP {status}"
    page = f"{hub.endpoint.rstrip('/')}/{ref.repo}"
    if error_code == "GatedRepo":
        if not hub.token:
            return PrefetchError(
                f"{where} is a gated repo on {hub.endpoint} ({answer}) and no token was sent:"
                f" accept the licence at {page} with your Hugging Face account and set HF_TOKEN"
                f" (or the Prefect Secret block '{TOKEN_SECRET_BLOCK}') to a token of that account"
            )
        return PrefetchError(
            f"{where} is a gated repo on {hub.endpoint} ({answer}) and the token from"
            f" {hub.token_source} has no access to it: accept the licence at {page} with the"
            " account that token belongs to (the repo's authors may have to approve it), or set"
            f" HF_TOKEN (or the Prefect Secret block '{TOKEN_SECRET_BLOCK}') to a token of an"
            " account that has access"
        )
    if status == 401 and error_code is None and detail == _INVALID_TOKEN_MESSAGE:
        return PrefetchError(
            f"the hub at {hub.endpoint} refused the token from {hub.token_source} for {where}"
            f" ({answer}: {detail}): the token is revoked, expired or mistyped; set HF_TOKEN (or"
            f" the Prefect Secret block '{TOKEN_SECRET_BLOCK}') to a valid token"
        )
    if error_code == "RepoNotFound" or (status == 401 and download is None):
        private = (
            f"; if it is private, the token from {hub.token_source} cannot read it"
            if hub.token
            else f"; if it is private, set HF_TOKEN (or the Prefect Secret block"
            f" '{TOKEN_SECRET_BLOCK}') to a token of an account that can read it"
        )
        return PrefetchError(
            f"{where} not found on {hub.endpoint} ({answer}): check the repo name in the"
            f" recipe{private}"
        )
    if error_code == "RevisionNotFound" and download is not None:
        return TransientPrefetchError(
            f"{where}: commit {download.sha} is no longer on the hub at {hub.endpoint} ({answer}"
            f" for {download.path}): the branch moved while this prefetch ran (a force-push);"
            " the next try takes its new head"
        )
    if error_code == "RevisionNotFound" or (status == 404 and download is None):
        return PrefetchError(
            f"{ref.repo} has no revision {ref.revision or 'main'!r} on {hub.endpoint}"
            f" ({answer}): fix the revision pinned in the recipe"
        )
    if download is not None and status == 404:
        return PrefetchError(
            f"{where}: {download.path} is in the file list of commit {download.sha} but"
            f" {download.url} answers {answer}: the hub has lost the file; tell the repo's"
            " owner, or pin another revision in the recipe"
        )
    if status in blobfetch.TRANSIENT_STATUS:
        error = TransientPrefetchError(
            f"the hub at {hub.endpoint} answered {answer} for {where}"
            + ("" if retry_after_s is None else f" with Retry-After: {retry_after_s:.0f} s")
            + _retry_hint(retry_after_s, hub)
        )
        error.retry_after_s = retry_after_s
        return error
    return PrefetchError(
        f"the hub at {hub.endpoint} answered {answer} for {where}"
        + (f" ({download.url})" if download is not None else "")
        + (f": {detail}" if detail else "")
    )


def _retry_hint(retry_after_s: float | None, hub: HubAccess) -> str:
    if retry_after_s is not None and retry_after_s > hub.max_retry_after_s:
        return (
            f", longer than the {hub.max_retry_after_s:.0f} s a prefetch waits in place: the"
            " task tries again later"
        )
    return ": a hub-side failure or a rate limit, retry later"


def _cause_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
