"""sparkdeploy.steps.prefetch.hub: a listed file's digests, and the access that hides its token."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from prefetch_hub import git_blob_oid

from sparkdeploy.remote import blobfetch
from sparkdeploy.steps.prefetch import HubAccess
from sparkdeploy.steps.prefetch.hub import HubFile


def test_hub_file_digests_match_sha256_and_the_git_blob_oid(tmp_path: Path) -> None:
    data = os.urandom((blobfetch.HASH_CHUNK_BYTES * 2) + 12345)
    path = tmp_path / "f"
    path.write_bytes(data)
    lfs = HubFile("f", len(data), git_blob_oid(data), hashlib.sha256(data).hexdigest())
    small = HubFile("f", len(data), git_blob_oid(data), None)
    for f in (lfs, small):
        digest = f.new_digest()
        blobfetch.hash_file(digest, path)
        assert digest.hexdigest() == f.expected_digest == f.blob_name
    prefix = hashlib.sha256()
    blobfetch.hash_file(prefix, path, 1000)
    assert prefix.hexdigest() == hashlib.sha256(data[:1000]).hexdigest()


def test_hub_access_repr_hides_the_token() -> None:
    assert "s3cret" not in repr(HubAccess("http://127.0.0.1:1", token="s3cret"))
