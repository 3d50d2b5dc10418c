"""The lab hub, driven by huggingface_hub 2.4's own client on 127.0.0.1.

Every client call names endpoint=hub.url and token explicitly, so no request leaves loopback
and no token from the environment is sent. The hub and its storage host listen on two ports of
127.0.0.1: two origins, as huggingface.co and its LFS storage are.
"""

import filecmp
import hashlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_XET", "1")

from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils.tqdm import disable_progress_bars

from lab.hub.control import HubControl
from lab.hub.request_log import HUB, STORAGE, fingerprint
from lab.hub.server import HubServer
from lab.tinymodel import EngramSpec, GeneratedRepo, generate_repo

TOKEN = "hf_lab_gate_token"


@pytest.fixture(scope="module")
def repos_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    disable_progress_bars()
    root = tmp_path_factory.mktemp("repos")
    generate_repo(root, "lab/tiny", num_shards=3, total_bytes=3 * 1024 * 1024, engram=EngramSpec())
    generate_repo(root, "lab/gated", gated_tokens=[TOKEN])
    generate_repo(root, "lab/large", num_shards=1, total_bytes=3 * DOWNLOAD_CHUNK_SIZE // 2)
    return root


@pytest.fixture(scope="module")
def tiny(repos_dir: Path) -> GeneratedRepo:
    path = repos_dir / "lab" / "tiny"
    return GeneratedRepo(path, "lab/tiny", tuple(sorted(p.name for p in path.iterdir())), ())


@pytest.fixture
def hub(repos_dir: Path) -> Iterator[HubServer]:
    with HubServer(repos_dir, page_size=4) as server:
        yield server


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def request(
    url: str,
    *,
    method: str = "GET",
    body: object = None,
    headers: dict[str, str] | None = None,
    follow: bool = True,
) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    opener = urllib.request.build_opener(*([] if follow else [_NoRedirects()]))
    try:
        with opener.open(req, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_snapshot_download_matches_byte_for_byte(
    hub: HubServer, tiny: GeneratedRepo, tmp_path: Path
) -> None:
    snapshot = Path(
        snapshot_download("lab/tiny", cache_dir=tmp_path, endpoint=hub.url, token=False)
    )
    sha = hub.repo_sha("lab/tiny")
    assert snapshot == tmp_path / "models--lab--tiny" / "snapshots" / sha
    assert (tmp_path / "models--lab--tiny" / "refs" / "main").read_text() == sha
    assert sorted(p.name for p in snapshot.iterdir()) == list(tiny.files)
    for name in tiny.files:
        assert filecmp.cmp(tiny.path / name, snapshot / name, shallow=False), name
    # LFS blobs are stored under their sha256, the others under their git blob id.
    shard = "model-00001-of-00005.safetensors"
    digest = hashlib.sha256((tiny.path / shard).read_bytes()).hexdigest()
    assert (snapshot / shard).resolve().name == digest
    config = (tiny.path / "config.json").read_bytes()
    git_oid = hashlib.sha1(f"blob {len(config)}\0".encode() + config).hexdigest()
    assert (snapshot / "config.json").resolve().name == git_oid
    assert hub.bytes_served == sum((tiny.path / name).stat().st_size for name in tiny.files)


def test_tree_is_paginated_and_complete(hub: HubServer, tiny: GeneratedRepo) -> None:
    api = HfApi(endpoint=hub.url, token=False)
    entries = list(api.list_repo_tree("lab/tiny", recursive=True))
    assert sorted(entry.path for entry in entries) == list(tiny.files)
    tree_calls = [r for r in hub.requests() if "/tree/" in r.path]
    assert len(tree_calls) == 3  # 10 files, 4 per page
    assert [("cursor=" in r.path) for r in tree_calls] == [False, True, True]
    by_path = {entry.path: entry for entry in entries if isinstance(entry, RepoFile)}
    shard = by_path["model-00001-of-00005.safetensors"]
    assert shard.lfs is not None
    assert shard.lfs.size == shard.size
    assert by_path["config.json"].lfs is None


def test_dry_run_lists_sizes_and_cache_state(hub: HubServer, tmp_path: Path) -> None:
    before = snapshot_download(
        "lab/tiny", cache_dir=tmp_path, endpoint=hub.url, token=False, dry_run=True
    )
    assert hub.bytes_served == 0
    sizes = {info.filename: info.file_size for info in before}
    assert sizes["config.json"] == (hub.repos_dir / "lab" / "tiny" / "config.json").stat().st_size
    assert all(info.will_download and not info.is_cached for info in before)
    hf_hub_download("lab/tiny", "config.json", cache_dir=tmp_path, endpoint=hub.url, token=False)
    after = snapshot_download(
        "lab/tiny", cache_dir=tmp_path, endpoint=hub.url, token=False, dry_run=True
    )
    cached = {info.filename for info in after if info.is_cached}
    assert cached == {"config.json"}


def test_5xx_then_success_on_the_clients_retry(hub: HubServer, tmp_path: Path) -> None:
    hub.fail_next(1, status=503)
    path = hf_hub_download(
        "lab/tiny", "config.json", cache_dir=tmp_path, endpoint=hub.url, token=False
    )
    assert Path(path).read_bytes() == (hub.repos_dir / "lab" / "tiny" / "config.json").read_bytes()
    assert [(r.method, r.status) for r in hub.requests()] == [
        ("HEAD", 503),
        ("HEAD", 200),
        ("GET", 200),
    ]


def test_cut_mid_file_then_resume_with_a_range_request(hub: HubServer, tmp_path: Path) -> None:
    # The client resumes from the last whole chunk it wrote, so cut past the first one.
    shard = "model-00001-of-00001.safetensors"
    size = (hub.repos_dir / "lab" / "large" / shard).stat().st_size
    cut = DOWNLOAD_CHUNK_SIZE + 12345
    hub.cut_next_file(after_bytes=cut)
    path = hf_hub_download("lab/large", shard, cache_dir=tmp_path, endpoint=hub.url, token=False)
    assert filecmp.cmp(path, hub.repos_dir / "lab" / "large" / shard, shallow=False)
    gets = [r for r in hub.requests() if r.method == "GET"]
    assert [(r.status, r.range, r.bytes_sent) for r in gets] == [
        (200, None, cut),
        (206, f"bytes={DOWNLOAD_CHUNK_SIZE}-", size - DOWNLOAD_CHUNK_SIZE),
    ]
    assert hub.bytes_served == size + cut - DOWNLOAD_CHUNK_SIZE


def test_slow_bytes_still_deliver_the_file(hub: HubServer, tmp_path: Path) -> None:
    hub.slow(2_000_000)
    path = hf_hub_download(
        "lab/tiny",
        "model-00001-of-00005.safetensors",
        cache_dir=tmp_path,
        endpoint=hub.url,
        token=False,
    )
    hub.reset_faults()
    assert filecmp.cmp(
        path, hub.repos_dir / "lab" / "tiny" / "model-00001-of-00005.safetensors", shallow=False
    )
    assert hub.faults().slow_bytes_per_s is None


def test_unknown_repo_revision_and_file(hub: HubServer, tmp_path: Path) -> None:
    # Anonymously a missing repo is 401 (the hub does not tell whether a private one exists).
    with pytest.raises(RepositoryNotFoundError) as anonymous:
        snapshot_download("lab/nope", cache_dir=tmp_path, endpoint=hub.url, token=False)
    assert anonymous.value.response.status_code == 401
    with pytest.raises(RepositoryNotFoundError) as authenticated:
        snapshot_download("lab/nope", cache_dir=tmp_path, endpoint=hub.url, token=TOKEN)
    assert authenticated.value.response.status_code == 404
    assert authenticated.value.response.headers["X-Error-Code"] == "RepoNotFound"
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(
            "lab/tiny", revision="v9", cache_dir=tmp_path, endpoint=hub.url, token=False
        )
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("lab/tiny", "nope.json", cache_dir=tmp_path, endpoint=hub.url, token=False)


def test_a_token_that_is_no_hub_token_is_refused_everywhere(hub: HubServer, tmp_path: Path) -> None:
    status, headers, _ = request(
        f"{hub.url}/api/models/lab/tiny", headers={"Authorization": "Bearer not-a-token"}
    )
    assert (status, headers["X-Error-Message"]) == (
        401,
        "Invalid credentials in Authorization header",
    )


def test_gated_repo_needs_the_token(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(GatedRepoError) as anonymous:
        snapshot_download("lab/gated", cache_dir=tmp_path, endpoint=hub.url, token=False)
    assert anonymous.value.response.status_code == 401
    assert "Please log in" in anonymous.value.response.headers["X-Error-Message"]
    with pytest.raises(GatedRepoError) as wrong:
        hf_hub_download(
            "lab/gated", "config.json", cache_dir=tmp_path, endpoint=hub.url, token="hf_wrong"
        )
    assert wrong.value.response.status_code == 403
    assert wrong.value.response.headers["X-Error-Message"] == (
        "Access to model lab/gated is restricted and you are not in the authorized list."
        f" Visit {hub.url}/lab/gated to ask for access."
    )
    snapshot = snapshot_download("lab/gated", cache_dir=tmp_path, endpoint=hub.url, token=TOKEN)
    assert (Path(snapshot) / "config.json").is_file()
    info = HfApi(endpoint=hub.url, token=False).model_info("lab/gated")
    assert info.gated == "manual"


def test_pinned_sha_and_revision_endpoint(hub: HubServer, tiny: GeneratedRepo) -> None:
    api = HfApi(endpoint=hub.url, token=False)
    sha = hub.repo_sha("lab/tiny")
    info = api.model_info("lab/tiny", revision=sha, files_metadata=True)
    assert info.sha == sha
    assert info.siblings is not None
    assert sorted(s.rfilename for s in info.siblings) == list(tiny.files)
    assert all(s.size == (tiny.path / s.rfilename).stat().st_size for s in info.siblings)


def test_range_requests(hub: HubServer, tiny: GeneratedRepo) -> None:
    url = f"{hub.url}/lab/tiny/resolve/main/config.json"
    content = (tiny.path / "config.json").read_bytes()
    status, headers, body = request(url, headers={"Range": "bytes=10-19"})
    assert (status, body, headers["Content-Range"]) == (
        206,
        content[10:20],
        f"bytes 10-19/{len(content)}",
    )
    assert request(url, headers={"Range": "bytes=-5"})[2] == content[-5:]
    status, headers, _ = request(url, headers={"Range": f"bytes={len(content)}-"})
    assert (status, headers["Content-Range"]) == (416, f"bytes */{len(content)}")
    status, headers, _ = request(url, method="HEAD")
    assert headers["X-Repo-Commit"] == hub.repo_sha("lab/tiny")
    assert headers["Content-Length"] == str(len(content))
    assert "X-Linked-Etag" not in headers
    # An LFS file is a redirect to the storage host, which answers ranges too.
    shard = "model-00001-of-00005.safetensors"
    data = (tiny.path / shard).read_bytes()
    status, headers, _ = request(
        f"{hub.url}/lab/tiny/resolve/main/{shard}", method="HEAD", follow=False
    )
    assert status == 302
    assert headers["Location"].startswith(f"{hub.storage_url}/lfs/lab/tiny/")
    status, headers, body = request(headers["Location"], headers={"Range": "bytes=100-199"})
    assert (status, body) == (206, data[100:200])
    assert headers["Content-Range"] == f"bytes 100-199/{len(data)}"


def test_an_lfs_file_is_redirected_to_storage_with_its_metadata(
    hub: HubServer, tiny: GeneratedRepo
) -> None:
    shard = "model-00001-of-00005.safetensors"
    data = (tiny.path / shard).read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    for method in ("HEAD", "GET"):
        status, headers, _ = request(
            f"{hub.url}/lab/tiny/resolve/main/{shard}", method=method, follow=False
        )
        assert status == 302, method
        assert headers["X-Linked-Size"] == str(len(data))
        assert headers["X-Linked-Etag"] == f'"{sha256}"'
        assert headers["X-Repo-Commit"] == hub.repo_sha("lab/tiny")
        assert headers["ETag"] != headers["X-Linked-Etag"]  # the git blob id of the pointer
    location = headers["Location"]
    status, headers, body = request(location)
    assert (status, body, headers["ETag"]) == (200, data, f'"{sha256}"')
    # Signed: a changed signature, or the same path without one, is refused.
    assert request(location[:-4] + "0000")[0] == 403
    assert request(location.split("?")[0])[0] == 403
    assert request(location.replace(sha256, "0" * 64))[0] == 403
    assert hub.bytes_served == len(data)


def test_the_token_reaches_the_hub_and_never_the_storage_host(
    hub: HubServer, repos_dir: Path, tmp_path: Path
) -> None:
    snapshot = snapshot_download("lab/gated", cache_dir=tmp_path, endpoint=hub.url, token=TOKEN)
    for name in ("config.json", "model-00001-of-00002.safetensors"):
        assert filecmp.cmp(Path(snapshot) / name, repos_dir / "lab" / "gated" / name, False)
    by_origin = hub.authorization_by_origin()
    assert by_origin == {HUB: [fingerprint(f"Bearer {TOKEN}")], STORAGE: []}
    storage_gets = [r for r in hub.requests() if r.origin == STORAGE and r.method == "GET"]
    assert storage_gets
    assert all(r.status == 200 for r in storage_gets)
    assert TOKEN not in json.dumps(hub.stats())


def test_429_carries_retry_after_and_the_client_retries(hub: HubServer, tmp_path: Path) -> None:
    hub.rate_limit(1, retry_after_s=1)
    status, headers, _ = request(f"{hub.url}/api/models/lab/tiny")
    assert (status, headers["Retry-After"]) == (429, "1")
    assert headers["RateLimit"] == '"api";r=0;t=1'
    hub.rate_limit(1, retry_after_s=1)
    path = hf_hub_download(
        "lab/tiny", "config.json", cache_dir=tmp_path, endpoint=hub.url, token=False
    )
    assert Path(path).read_bytes() == (hub.repos_dir / "lab" / "tiny" / "config.json").read_bytes()
    # The API call's 429, then the download's: its HEAD retried once the wait was over.
    assert [(r.method, r.status) for r in hub.requests()] == [
        ("GET", 429),
        ("HEAD", 429),
        ("HEAD", 200),
        ("GET", 200),
    ]


def test_faults_over_http(hub: HubServer) -> None:
    faults = f"{hub.url}/_lab/faults"
    status, _, body = request(faults, method="POST", body={"fail_next": 2, "status": 500})
    assert status == 200
    assert json.loads(body)["fail_remaining"] == 2
    info = f"{hub.url}/api/models/lab/tiny"
    assert [request(info)[0] for _ in range(3)] == [500, 500, 200]
    status, _, body = request(faults, method="POST", body={"cut_next_file": 7, "slow": 5})
    state = json.loads(body)
    assert (state["cut_after_bytes"], state["slow_bytes_per_s"]) == (7, 5)
    assert json.loads(request(faults, method="POST", body={"reset": True})[2]) == {
        "fail_remaining": 0,
        "fail_status": 503,
        "retry_after_s": None,
        "cut_after_bytes": None,
        "slow_bytes_per_s": None,
    }
    status, _, body = request(
        faults, method="POST", body={"fail_next": 1, "status": 429, "retry_after": 3}
    )
    assert json.loads(body)["retry_after_s"] == 3
    status, headers, _ = request(info)
    assert (status, headers["Retry-After"]) == (429, "3")
    status, _, body = request(faults, method="POST", body={"fail_nxt": 1})
    assert status == 400
    assert b"unknown fault keys ['fail_nxt']" in body
    status, _, body = request(faults, method="POST", body={"fail_next": "2"})
    assert status == 400


def test_stats_over_http(hub: HubServer) -> None:
    request(f"{hub.url}/lab/tiny/resolve/main/config.json")
    stats = json.loads(request(f"{hub.url}/_lab/stats")[2])
    size = (hub.repos_dir / "lab" / "tiny" / "config.json").stat().st_size
    assert (stats["requests"], stats["bytes_served"]) == (1, size)
    assert stats["log"][0]["path"] == "/lab/tiny/resolve/main/config.json"
    reset = json.loads(request(f"{hub.url}/_lab/stats", method="POST", body={"reset": True})[2])
    assert (reset["requests"], reset["bytes_served"], reset["log"]) == (0, 0, [])


def test_a_new_revision_changes_the_sha(tmp_path: Path) -> None:
    generate_repo(tmp_path, "lab/rev")
    with HubServer(tmp_path) as server:
        first = server.repo_sha("lab/rev")
        generate_repo(tmp_path, "lab/rev")
        assert server.repo_sha("lab/rev") == first  # same content, same sha
        generate_repo(tmp_path, "lab/rev", revision="2")
        assert server.repo_sha("lab/rev") != first


def test_command_line_server(repos_dir: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "lab.hub", "--repos", str(repos_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    try:
        assert process.stdout is not None
        started: dict[str, Any] = json.loads(process.stdout.readline())
        assert started["pid"] == process.pid
        assert started["storage_url"] != started["url"]
        status, _, body = request(f"{started['url']}/api/models/lab/tiny/revision/main")
        assert status == 200
        assert json.loads(body)["id"] == "lab/tiny"
        control = HubControl(started["url"])
        assert control.set_faults(fail_next=1, status=429).fail_status == 429
        assert request(f"{started['url']}/api/models/lab/tiny")[0] == 429
        assert [(r.origin, r.status) for r in control.requests()] == [(HUB, 200), (HUB, 429)]
        control.reset_stats()
        assert control.stats()["requests"] == 0
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
