"""Prefect task: every repo of the plan into the NAS HF cache (logic in sparkdeploy.steps.prefetch).

The hub token is read here, inside the task, from the Prefect Secret block `hf-token` or
HF_TOKEN: it is never a task parameter, so it never lands in the run's recorded parameters, logs
or artifacts.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast
from uuid import UUID

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.blocks.system import Secret
from prefect.logging import get_run_logger

from sparkdeploy.errors import TransientPrefetchError
from sparkdeploy.steps.prefetch import (
    PUBLIC_HUB,
    TOKEN_SECRET_BLOCK,
    HubAccess,
    Progress,
    RepoLike,
    RepoOutcome,
    prefetch,
)
from sparkdeploy.steps.prefetch.selection import FileSelection
from sparkdeploy.units import human_bytes
from tasks.artifacts import publish_table
from tasks.common import retried_on

PROGRESS_ARTIFACT_KEY = "prefetch-progress"
FILES_ARTIFACT_KEY = "prefetch-files"


def load_hub_token() -> tuple[str | None, str]:
    """The Secret block's value if the block exists, else HF_TOKEN, else None (anonymous); and
    where it came from, for the errors about it."""
    try:
        # Prefect's dispatch types the call as maybe-a-coroutine; from sync code it is the block.
        secret = cast(Secret[str], Secret.load(TOKEN_SECRET_BLOCK))
        return str(secret.get()), f"the Prefect Secret block '{TOKEN_SECRET_BLOCK}'"
    except ValueError:  # Prefect's answer for a block that does not exist
        return os.environ.get("HF_TOKEN") or None, "HF_TOKEN"


def hub_access(
    endpoint: str | None, *, allow_http_token: bool, max_workers: int = HubAccess.max_workers
) -> HubAccess:
    """The hub the inventory names (else HF_ENDPOINT, else the public hub), with the token of
    load_hub_token."""
    token, token_source = load_hub_token()
    return HubAccess(
        endpoint=endpoint or os.environ.get("HF_ENDPOINT") or PUBLIC_HUB,
        token=token,
        token_source=token_source,
        max_workers=max_workers,
        allow_http_token=allow_http_token,
    )


class PrefectReporter:
    """Turns prefetch progress into a progress artifact and log lines, both rate limited."""

    def __init__(
        self,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
        *,
        log_every_s: float = 15.0,
        artifact_every_s: float = 2.0,
    ) -> None:
        self._logger = logger
        # Made at the first byte to fetch: a warm prefetch has no progress to show.
        self._artifact_id: UUID | None = None
        self._log_every_s = log_every_s
        self._artifact_every_s = artifact_every_s
        self._last_log = 0.0
        self._last_artifact = 0.0

    def on_progress(self, progress: Progress) -> None:
        now = time.monotonic()
        finished = progress.done_bytes >= progress.total_bytes
        percent = (
            100.0 * progress.done_bytes / progress.total_bytes if progress.total_bytes else 100.0
        )
        if finished or now - self._last_artifact >= self._artifact_every_s:
            if self._artifact_id is None:
                self._artifact_id = cast(
                    UUID,
                    create_progress_artifact(
                        progress=percent,
                        key=PROGRESS_ARTIFACT_KEY,
                        description="Bytes fetched into the NAS HF cache",
                    ),
                )
            else:
                update_progress_artifact(self._artifact_id, percent)
            self._last_artifact = now
        if finished or now - self._last_log >= self._log_every_s:
            eta = f"{progress.eta_s:.0f} s" if progress.eta_s is not None else "unknown"
            self._logger.info(
                "prefetch %s: %s of %s (%.0f%%), %s/s, ETA %s",
                progress.repo,
                human_bytes(progress.done_bytes),
                human_bytes(progress.total_bytes),
                percent,
                human_bytes(progress.rate_bps),
                eta,
            )
            self._last_log = now

    def on_message(self, message: str) -> None:
        self._logger.info("%s", message)


def files_table(outcomes: Sequence[RepoOutcome]) -> list[dict[str, Any]]:
    return [
        {
            "repo": outcome.repo,
            "commit": outcome.sha[:12],
            "file": f.path,
            "size": human_bytes(f.size),
            "bytes": f.size,
            "verified": f.verified,
            "status": "fetched" if f.fetched else "cached",
        }
        for outcome in outcomes
        for f in outcome.files
    ]


@task(
    name="prefetch",
    **retried_on(TransientPrefetchError, 10, 60, 300),
)
def prefetch_repos(
    repos: Sequence[RepoLike],
    nas_hf_cache: str,
    endpoint: str | None = None,
    max_workers: int = 8,
    allow_http_token: bool = False,
    update_revisions: bool = False,
    rehash: bool = False,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> list[RepoOutcome]:
    """Put every repo (at its pinned revision, if any; an unpinned one at the commit the NAS
    holds, unless update_revisions) into the NAS HF cache on the flow host; rehash: hash every
    file again. Only the files an engine reads, plus `include` and less `exclude` (the recipe's
    [prefetch] patterns), are fetched."""
    logger = get_run_logger()
    hub = hub_access(endpoint, allow_http_token=allow_http_token, max_workers=max_workers)
    logger.info(
        "prefetch of %d repos from %s into %s (%s)",
        len(repos),
        hub.endpoint,
        nas_hf_cache,
        "authenticated" if hub.token else "anonymous",
    )
    outcomes = prefetch(
        repos,
        Path(nas_hf_cache),
        hub,
        observer=PrefectReporter(logger),
        update_revisions=update_revisions,
        rehash=rehash,
        selection=FileSelection(tuple(include), tuple(exclude)),
    )
    fetched = sum(o.fetched_bytes for o in outcomes)
    publish_table(
        table=files_table(outcomes),
        key=FILES_ARTIFACT_KEY,
        description=(
            f"{sum(len(o.files) for o in outcomes)} files in {len(outcomes)} repos; "
            f"fetched {human_bytes(fetched)}"
        ),
    )
    return outcomes
