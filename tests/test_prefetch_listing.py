"""The hub's listing is untrusted: a file name, commit sha or blob id that would put a path outside
the NAS cache is refused before anything is written, naming the entry; a token is never sent to
a plain-http hub unless the inventory allows it. The hostile hub is a real HTTP server on
loopback that answers the two calls the prefetch makes (the revision's info, a file's bytes)."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prefetch_hub import git_blob_oid

from sparkdeploy.errors import PrefetchError
from sparkdeploy.steps.prefetch import HubAccess, RepoSpec, prefetch

REPO = "evil-org/tiny"
GOOD_SHA = "0123456789abcdef0123456789abcdef01234567"
DATA = b"planted\n"


class HostileHub:
    """Lists one file under whatever name, sha and blob id the test sets, and serves DATA for
    any file; records the requests' paths."""

    def __init__(self) -> None:
        self.sha = GOOD_SHA
        self.rfilename = "config.json"
        self.blob_id = git_blob_oid(DATA)
        self.lfs_sha256: str | None = None
        self.paths: list[str] = []
        self.authorizations: list[str | None] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub.paths.append(self.path)
                hub.authorizations.append(self.headers.get("authorization"))
                if self.path.startswith("/api/models/"):
                    body = json.dumps(hub.info()).encode()
                    self.send_response(200)
                    self.send_header("content-type", "application/json")
                else:
                    body = DATA
                    self.send_response(200)
                    self.send_header("etag", f'"{hub.blob_id}"')
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def info(self) -> dict[str, Any]:
        sibling: dict[str, Any] = {
            "rfilename": self.rfilename,
            "size": len(DATA),
            "blobId": self.blob_id,
        }
        if self.lfs_sha256 is not None:
            sibling["lfs"] = {"sha256": self.lfs_sha256, "size": len(DATA), "pointerSize": 130}
        return {"id": REPO, "modelId": REPO, "sha": self.sha, "siblings": [sibling]}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hostile() -> Iterator[HostileHub]:
    hub = HostileHub()
    yield hub
    hub.close()


def _everything_under(root: Path) -> set[Path]:
    return set(root.rglob("*"))


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("rfilename", "../../../../escaped", "file name '../../../../escaped'"),
        ("rfilename", "sub/../../../escaped", "file name 'sub/../../../escaped'"),
        ("rfilename", "/tmp/absolute-escape", "file name '/tmp/absolute-escape'"),
        ("rfilename", "", "file name ''"),
        ("sha", "../../../../escaped", "commit sha '../../../../escaped'"),
        ("sha", "0123456789ABCDEF0123456789abcdef0123456G", "commit sha"),
        ("blob_id", "../../../escaped", "blob id '../../../escaped'"),
        ("lfs_sha256", "../../escaped" + "0" * 51, "sha256 '../../escaped"),
    ],
)
def test_a_listing_entry_that_is_no_safe_path_is_refused_and_nothing_is_written(
    hostile: HostileHub, tmp_path: Path, field: str, value: str, named: str
) -> None:
    setattr(hostile, field, value)
    nas = tmp_path / "deep" / "er" / "nas"
    nas.mkdir(parents=True)
    before = _everything_under(tmp_path)
    with pytest.raises(PrefetchError) as raised:
        prefetch([RepoSpec(REPO)], nas, HubAccess(hostile.url))
    message = str(raised.value)
    assert named in message, message
    assert f"{REPO}@main" in message, message
    assert "refused" in message, message
    assert _everything_under(tmp_path) == before, "the prefetch wrote before refusing"
    assert not any("/resolve/" in path for path in hostile.paths), hostile.paths


def test_a_clean_listing_from_the_same_hub_is_fetched(hostile: HostileHub, tmp_path: Path) -> None:
    [outcome] = prefetch([RepoSpec(REPO)], tmp_path, HubAccess(hostile.url))
    assert outcome.sha == GOOD_SHA
    assert outcome.fetched_bytes == len(DATA)
    assert (Path(outcome.snapshot_dir) / "config.json").read_bytes() == DATA


def test_an_lfs_file_with_a_safe_sha256_is_fetched(hostile: HostileHub, tmp_path: Path) -> None:
    hostile.lfs_sha256 = hashlib.sha256(DATA).hexdigest()
    [outcome] = prefetch([RepoSpec(REPO)], tmp_path, HubAccess(hostile.url))
    assert outcome.files[0].verified == "sha256"


def test_a_token_is_not_sent_to_a_plain_http_hub_unless_allowed(
    hostile: HostileHub, tmp_path: Path
) -> None:
    with pytest.raises(PrefetchError) as raised:
        prefetch([RepoSpec(REPO)], tmp_path, HubAccess(hostile.url, token="hf_sentinel"))
    message = str(raised.value)
    assert "http://" in message, message
    assert "[hub].allow_http_token" in message, message
    assert "hf_sentinel" not in message
    assert hostile.paths == [], "a request went out with the token"
    allowed = HubAccess(hostile.url, token="hf_sentinel", allow_http_token=True)
    [outcome] = prefetch([RepoSpec(REPO)], tmp_path, allowed)
    assert outcome.fetched_bytes == len(DATA)
    assert "Bearer hf_sentinel" in hostile.authorizations


def test_a_recipe_revision_that_is_no_safe_ref_name_is_refused(
    hostile: HostileHub, tmp_path: Path
) -> None:
    with pytest.raises(PrefetchError, match=r"revision '\.\./\.\./escaped'") as raised:
        prefetch([RepoSpec(REPO, "../../escaped")], tmp_path, HubAccess(hostile.url))
    assert "refused" in str(raised.value)
    assert not (tmp_path.parent / "escaped").exists()
