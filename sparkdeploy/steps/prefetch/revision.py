"""What a revision is: its commit sha and its files with size, git oid and LFS sha256, from one
huggingface_hub call, so the two agree. A rate limit (429, or a 503 with Retry-After) is waited
out in place, up to HubAccess.max_retry_after_s; any other refusal is raised at once."""

from __future__ import annotations

import time

from huggingface_hub import HfApi
from huggingface_hub.hf_api import ModelInfo

from sparkdeploy.errors import PrefetchError, TransientPrefetchError
from sparkdeploy.steps.prefetch.hub import HubAccess, HubFile, RepoLike
from sparkdeploy.steps.prefetch.hub_errors import hub_errors
from sparkdeploy.steps.prefetch.names import check_listing
from sparkdeploy.steps.prefetch.progress import PrefetchObserver
from sparkdeploy.steps.prefetch.selection import ENGINE_SELECTION, FileSelection


def hub_api(hub: HubAccess) -> HfApi:
    # token=False, not None: None would make huggingface_hub pick up a token from the
    # environment or ~/.cache/huggingface on its own, and the caller decides where it comes from.
    return HfApi(endpoint=hub.endpoint, token=hub.token if hub.token else False)


def revision_files(
    api: HfApi,
    ref: RepoLike,
    hub: HubAccess,
    observer: PrefetchObserver,
    *,
    selection: FileSelection = ENGINE_SELECTION,
) -> tuple[str, list[HubFile]]:
    """The revision's commit sha and the files of it that `selection` takes, from one hub call
    (so the two agree); refused when a name in it is no safe path (names.check_listing)."""
    info = _model_info(api, ref, hub, observer)
    not_a_hub = (
        f"the hub at {hub.endpoint} returned no commit sha or no file sizes and oids for "
        f"{ref.repo}@{ref.revision or 'main'}: is HF_ENDPOINT a Hugging Face hub?"
    )
    if not info.sha:
        raise PrefetchError(not_a_hub)
    files: list[HubFile] = []
    for sibling in info.siblings or []:
        if sibling.size is None or sibling.blob_id is None:
            raise PrefetchError(not_a_hub)
        lfs_sha256 = sibling.lfs.sha256 if sibling.lfs is not None else None
        files.append(HubFile(sibling.rfilename, sibling.size, sibling.blob_id, lfs_sha256))
    check_listing(ref, hub, info.sha, files)
    return info.sha, selection.select(files)


def _model_info(api: HfApi, ref: RepoLike, hub: HubAccess, observer: PrefetchObserver) -> ModelInfo:
    """The revision's info, asked again after the wait the hub's Retry-After asks for (a rate
    limit), up to hub.download_attempts times; any other failure is raised at once."""
    attempt = 1
    while True:
        try:
            with hub_errors(ref, hub):
                return api.model_info(
                    ref.repo,
                    revision=ref.revision,
                    files_metadata=True,
                    timeout=hub.request_timeout_s,
                )
        except TransientPrefetchError as exc:
            wait = exc.retry_after_s
            if wait is None or wait > hub.max_retry_after_s or attempt >= hub.download_attempts:
                raise
            attempt += 1
            observer.on_message(
                f"{exc}; waiting the {wait:.0f} s its Retry-After asks for, then asking again"
                f" (attempt {attempt} of {hub.download_attempts})"
            )
            time.sleep(wait)
