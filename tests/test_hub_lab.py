"""The prefetch against the lab's own hub: real HTTP between the host and the hub process in the
lab's bridge namespace, whose storage host is a second address there (another origin), and the
bytes written into the lab's NAS HF cache."""

from __future__ import annotations

import http.client
import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from lab.cluster import Lab
from lab.hub.control import HubControl
from lab.hub.request_log import HUB, STORAGE, fingerprint
from lab.tinymodel import generate_repo
from sparkdeploy.errors import PrefetchError, TransientPrefetchError
from sparkdeploy.steps import prefetch as pf
from sparkdeploy.steps.prefetch.cache import MANIFEST_DIRNAME, storage_dir

pytestmark = pytest.mark.lab

GATED = "lab-hubtest/gated"
OPEN = "lab-hubtest/open"
TOKEN = "hf_lab_hubtest_token"


class Messages:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def on_progress(self, progress: pf.Progress) -> None:
        pass

    def on_message(self, message: str) -> None:
        self.lines.append(message)


@pytest.fixture(scope="module")
def lab_hub(lab_cluster: Lab) -> Iterator[HubControl]:
    """The lab's hub with two repos of this module; both, and what the NAS got of them, are
    removed afterwards."""
    repos = lab_cluster.hub_repos_dir
    generate_repo(repos, GATED, num_shards=2, total_bytes=2 << 20, gated_tokens=[TOKEN])
    generate_repo(repos, OPEN, num_shards=2, total_bytes=1 << 20)
    try:
        yield HubControl(lab_cluster.hub_url)
    finally:
        shutil.rmtree(repos / "lab-hubtest", ignore_errors=True)
        for repo in (GATED, OPEN):
            (repos / f"{repo}.gated").unlink(missing_ok=True)
            shutil.rmtree(storage_dir(nas_cache(lab_cluster), repo), ignore_errors=True)


@pytest.fixture
def hub(lab_hub: HubControl, lab_cluster: Lab) -> HubControl:
    """A clean slate per test: no faults, an empty request log, nothing of the repos in the
    NAS."""
    lab_hub.set_faults(reset=True)
    lab_hub.reset_stats()
    for repo in (GATED, OPEN):
        shutil.rmtree(storage_dir(nas_cache(lab_cluster), repo), ignore_errors=True)
    return lab_hub


def nas_cache(lab: Lab) -> Path:
    return lab.nas_dir / "hf-cache"


def prefetch(
    lab: Lab, repo: str, token: str | None = None, *, revision: str | None = None
) -> tuple[pf.RepoOutcome, Messages]:
    """The repo into the lab's NAS from the lab's hub, as the prefetch task does it."""
    messages = Messages()
    access = pf.HubAccess(
        lab.hub_url, token=token, token_source="HF_TOKEN", max_workers=2, allow_http_token=True
    )
    [outcome] = pf.prefetch(
        [pf.RepoSpec(repo, revision)], nas_cache(lab), access, observer=messages
    )
    return outcome, messages


def matches_the_hub(lab: Lab, outcome: pf.RepoOutcome) -> bool:
    source = lab.hub_repos_dir / outcome.repo
    return all(
        (Path(outcome.snapshot_dir) / f.path).read_bytes() == (source / f.path).read_bytes()
        for f in outcome.files
    )


def nothing_complete_left(lab: Lab, repo: str) -> bool:
    """No manifest, blob or snapshot entry of the repo in the NAS: nothing a later step could
    take for a complete file."""
    storage = storage_dir(nas_cache(lab), repo)
    manifests = list((storage / MANIFEST_DIRNAME).glob("*.json"))
    blobs = [p for p in (storage / "blobs").glob("*") if p.is_file()]
    return not manifests and not blobs and not (storage / "snapshots").exists()


def test_lfs_files_come_from_the_storage_host_without_the_token(
    hub: HubControl, lab_cluster: Lab
) -> None:
    outcome, _ = prefetch(lab_cluster, GATED, TOKEN)
    assert outcome.fetched_bytes == outcome.total_bytes
    assert matches_the_hub(lab_cluster, outcome)
    lfs = {f.path for f in outcome.files if f.verified == "sha256"}
    requests = hub.requests()
    redirects = [r for r in requests if r.origin == HUB and r.status == 302]
    stored = [r for r in requests if r.origin == STORAGE]
    assert len(redirects) == len(stored) == len(lfs) == 2
    assert all(r.status == 200 and "/lfs/lab-hubtest/gated/" in r.path for r in stored)
    # The token went to the hub with every request, and never to the storage origin.
    assert all(r.authorized for r in requests if r.origin == HUB)
    assert hub.authorization_by_origin() == {HUB: [fingerprint(f"Bearer {TOKEN}")], STORAGE: []}
    # The storage host is the lab's second address: another origin than the hub's.
    shard = sorted(lfs)[0]
    connection = http.client.HTTPConnection(urlsplit(lab_cluster.hub_url).netloc, timeout=10)
    connection.request(
        "HEAD",
        f"/{GATED}/resolve/{outcome.sha}/{shard}",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    redirect = connection.getresponse()
    connection.close()
    assert redirect.status == 302
    assert (redirect.getheader("Location") or "").startswith(
        f"{lab_cluster.layout.hub_storage_url}/lfs/{GATED}/"
    )
    assert redirect.getheader("X-Repo-Commit") == outcome.sha
    assert redirect.getheader("X-Linked-Size") == str(
        next(f.size for f in outcome.files if f.path == shard)
    )


def test_a_gated_repo_names_the_licence_page_and_leaves_nothing_complete(
    hub: HubControl, lab_cluster: Lab
) -> None:
    with pytest.raises(PrefetchError) as anonymous:
        prefetch(lab_cluster, GATED)
    message = str(anonymous.value)
    assert f"accept the licence at {lab_cluster.hub_url}/{GATED}" in message
    assert "no token was sent" in message
    assert "set HF_TOKEN" in message
    assert not isinstance(anonymous.value, TransientPrefetchError)
    with pytest.raises(PrefetchError, match="the token from HF_TOKEN has no access") as wrong:
        prefetch(lab_cluster, GATED, "hf_not_on_the_list")
    assert "hf_not_on_the_list" not in str(wrong.value)
    assert nothing_complete_left(lab_cluster, GATED)
    assert not [r for r in hub.requests() if r.origin == STORAGE]
    # With the token, the same cache completes.
    outcome, _ = prefetch(lab_cluster, GATED, TOKEN)
    assert matches_the_hub(lab_cluster, outcome)


def test_a_missing_repo_or_revision_is_named_with_the_fix(
    hub: HubControl, lab_cluster: Lab
) -> None:
    with pytest.raises(PrefetchError) as missing:
        prefetch(lab_cluster, "lab-hubtest/nope")
    assert "lab-hubtest/nope@main not found" in str(missing.value)
    assert "HTTP 401 RepoNotFound" in str(missing.value)
    assert "check the repo name in the recipe" in str(missing.value)
    with pytest.raises(PrefetchError, match="HTTP 404 RepoNotFound"):
        prefetch(lab_cluster, "lab-hubtest/nope", TOKEN)
    with pytest.raises(PrefetchError) as revision:
        prefetch(lab_cluster, OPEN, revision="v9")
    assert f"{OPEN} has no revision 'v9'" in str(revision.value)
    assert "fix the revision pinned in the recipe" in str(revision.value)
    for error in (missing.value, revision.value):
        assert not isinstance(error, TransientPrefetchError)
    assert nothing_complete_left(lab_cluster, OPEN)


def test_a_rate_limit_is_waited_out_as_retry_after_says(hub: HubControl, lab_cluster: Lab) -> None:
    hub.set_faults(fail_next=2, status=429, retry_after=1)
    outcome, messages = prefetch(lab_cluster, OPEN)
    assert matches_the_hub(lab_cluster, outcome)
    assert [r.status for r in hub.requests()][:3] == [429, 429, 200]
    waits = [line for line in messages.lines if "Retry-After" in line]
    assert [("HTTP 429" in line, "waiting the 1 s" in line) for line in waits] == [(True, True)] * 2
