"""sparkdeploy.steps.prefetch.hub_errors: the hub's refusals named with the fix, from
huggingface_hub's errors and from a download's status; then a gated repo through the whole
prefetch."""

from __future__ import annotations

import pickle
from pathlib import Path

import httpx2
import pytest
from huggingface_hub import hf_raise_for_status
from huggingface_hub.errors import HfHubHTTPError
from prefetch_hub import SHA, fetch

from lab.hub.server import HubServer
from lab.tinymodel import generate_repo
from sparkdeploy.errors import PrefetchError, TransientPrefetchError
from sparkdeploy.steps.prefetch import HubAccess, RepoSpec
from sparkdeploy.steps.prefetch.cache import MANIFEST_DIRNAME, storage_dir
from sparkdeploy.steps.prefetch.hub_errors import FileDownload, map_hub_error, status_error

pytest_plugins = ["prefetch_fixtures"]


def http_error(status: int, **headers: str) -> HfHubHTTPError:
    """What huggingface_hub raises for a hub answer: headers as the hub sends them (X-Error-Code
    as X_Error_Code)."""
    request = httpx2.Request("GET", "http://127.0.0.1:1/api/models/org/x")
    response = httpx2.Response(
        status,
        request=request,
        headers={name.replace("_", "-"): value for name, value in headers.items()},
    )
    try:
        hf_raise_for_status(response)
    except HfHubHTTPError as error:
        return error
    raise AssertionError(f"HTTP {status} raised nothing")


ANONYMOUS = HubAccess("http://127.0.0.1:1")
WITH_TOKEN = HubAccess(
    "http://127.0.0.1:1", token="hf_x", token_source="HF_TOKEN", allow_http_token=True
)


@pytest.mark.parametrize(
    ("error", "hub", "kind", "words"),
    [
        (
            http_error(401, X_Error_Code="GatedRepo"),
            ANONYMOUS,
            PrefetchError,
            [
                "org/x@main is a gated repo",
                "no token was sent",
                "accept the licence at http://127.0.0.1:1/org/x",
                "set HF_TOKEN (or the Prefect Secret block 'hf-token')",
            ],
        ),
        (
            http_error(403, X_Error_Code="GatedRepo"),
            WITH_TOKEN,
            PrefetchError,
            ["HTTP 403 GatedRepo", "the token from HF_TOKEN has no access", "licence"],
        ),
        (
            http_error(401, X_Error_Code="RepoNotFound"),
            ANONYMOUS,
            PrefetchError,
            ["org/x@main not found", "HTTP 401 RepoNotFound", "repo name", "HF_TOKEN"],
        ),
        (
            http_error(404, X_Error_Code="RepoNotFound"),
            WITH_TOKEN,
            PrefetchError,
            ["org/x@main not found", "the token from HF_TOKEN cannot read it"],
        ),
        (
            http_error(404, X_Error_Code="RevisionNotFound"),
            ANONYMOUS,
            PrefetchError,
            ["org/x has no revision 'main'", "fix the revision pinned in the recipe"],
        ),
        (
            http_error(401, X_Error_Message="Invalid credentials in Authorization header"),
            WITH_TOKEN,
            PrefetchError,
            ["refused the token from HF_TOKEN", "revoked, expired or mistyped"],
        ),
        (http_error(503), ANONYMOUS, TransientPrefetchError, ["HTTP 503", "retry later"]),
        (
            http_error(429, Retry_After="7"),
            ANONYMOUS,
            TransientPrefetchError,
            ["HTTP 429 for org/x@main with Retry-After: 7 s", "retry later"],
        ),
        (
            http_error(429, Retry_After="900"),
            ANONYMOUS,
            TransientPrefetchError,
            ["Retry-After: 900 s, longer than the 300 s a prefetch waits in place"],
        ),
        (
            httpx2.ConnectError("Connection refused"),
            ANONYMOUS,
            TransientPrefetchError,
            ["cannot reach"],
        ),
    ],
)
def test_hub_errors_map_to_clear_errors_naming_the_repo(
    error: Exception, hub: HubAccess, kind: type[PrefetchError], words: list[str]
) -> None:
    wrapped = OSError("wrapper")
    wrapped.__cause__ = error
    mapped = map_hub_error(wrapped, RepoSpec("org/x"), hub)
    assert type(mapped) is kind
    for word in words:
        assert word in str(mapped)
    assert "hf_x" not in str(mapped)


def test_a_429s_wait_travels_with_the_error_and_survives_pickling() -> None:
    mapped = map_hub_error(http_error(429, Retry_After="7"), RepoSpec("org/x"), ANONYMOUS)
    assert isinstance(mapped, TransientPrefetchError)
    assert pickle.loads(pickle.dumps(mapped)).retry_after_s == mapped.retry_after_s == 7.0


@pytest.mark.parametrize(
    ("status", "code", "kind", "words"),
    [
        (
            404,
            "EntryNotFound",
            PrefetchError,
            ["w.safetensors is in the file list of commit", "lost the file", "pin another"],
        ),
        (404, "RevisionNotFound", TransientPrefetchError, ["force-push", "new head"]),
        (401, "GatedRepo", PrefetchError, ["is a gated repo", "accept the licence"]),
    ],
)
def test_download_refusals_name_the_file_and_the_fix(
    status: int, code: str, kind: type[PrefetchError], words: list[str]
) -> None:
    download = FileDownload("w.safetensors", SHA, "http://127.0.0.1:1/org/x/resolve/sha/w")
    mapped = status_error(status, RepoSpec("org/x"), ANONYMOUS, error_code=code, download=download)
    assert type(mapped) is kind
    for word in words:
        assert word in str(mapped)


def test_gated_repo_names_the_repo_and_the_token_source(repos_dir: Path, nas: Path) -> None:
    generate_repo(repos_dir, "lab-org/gated", total_bytes=64 << 10, gated_tokens=["hf_good"])
    storage = storage_dir(nas, "lab-org/gated")
    with HubServer(repos_dir) as hub:
        with pytest.raises(PrefetchError, match="lab-org/gated") as anonymous:
            fetch(hub, nas, repo="lab-org/gated")
        assert "no token was sent" in str(anonymous.value)
        assert f"accept the licence at {hub.url}/lab-org/gated" in str(anonymous.value)
        assert "'hf-token'" in str(anonymous.value)
        with pytest.raises(PrefetchError, match="has no access") as wrong:
            fetch(hub, nas, repo="lab-org/gated", token="hf_wrong")
        assert "hf_wrong" not in str(wrong.value)
        assert not isinstance(wrong.value, TransientPrefetchError)
        # Nothing of the refused downloads is left, least of all as complete.
        assert not list(storage.rglob("*.incomplete"))
        assert not list((storage / MANIFEST_DIRNAME).glob("*.json"))
        assert not [p for p in storage.rglob("*") if p.is_file() and "blobs" in p.parts]
        assert fetch(hub, nas, repo="lab-org/gated", token="hf_good").fetched_bytes > 0
