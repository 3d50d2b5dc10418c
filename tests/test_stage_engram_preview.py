"""The staging script's dry run (a preview): what stage_all would do with each shard, said
before it, byte for byte as the staging then reports it, and nothing written on the node."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from test_stage_engram import REPO, Nas, engram_stage, make_nas, stage
from test_stage_engram_adopt import hand_made_copy

from lab.testing.local_node import LocalNode
from sparkdeploy.steps.preview.staging import engram_dry_run


@pytest.fixture
def nas(tmp_path: Path) -> Nas:
    return make_nas(tmp_path)


def _tree(root: Path) -> dict[str, tuple[int, int, str]]:
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(directory) / name
            st = path.lstat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
            found[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns, digest)
    return found


def dry_run(nas: Nas, dest: Path, ranks: list[int]) -> dict[str, object]:
    """The dry run's one shard, checking that nothing under the NAS or the dest's dir changed
    (nor the node script's code cache: the script is built not to write it)."""
    watched = [nas.hf_cache, dest.parent]
    for path in watched:
        path.mkdir(parents=True, exist_ok=True)
    before = [_tree(path) for path in watched]
    [shard] = engram_dry_run(
        LocalNode(),
        "node-test",
        nas_hf_cache=str(nas.hf_cache),
        stages=[engram_stage(REPO, nas.filename, dest, ranks)],
        composed_root=None,
    )
    assert [_tree(path) for path in watched] == before
    assert shard["dest"] == str(dest)
    return shard


def test_a_copy_then_a_skip_are_said_before_they_happen(nas: Nas, tmp_path: Path) -> None:
    dest = tmp_path / "local" / nas.filename
    first = dry_run(nas, dest, [1])
    assert not dest.exists()
    copied = stage(nas, dest, [1])
    assert (first["action"], copied.status) == ("copy", "copied")
    assert first["bytes"] == copied.copied_bytes

    again = dry_run(nas, dest, [1])
    assert (again["action"], again["bytes"]) == ("skip", 0)
    assert stage(nas, dest, [1]).status == "skipped"


def test_an_interrupted_copy_is_said_to_resume_with_the_bytes_left(
    nas: Nas, tmp_path: Path
) -> None:
    dest = tmp_path / "local" / nas.filename
    with pytest.raises(Exception, match="stopped on request"):
        stage(nas, dest, [1], stop_after_chunks=4)
    found = dry_run(nas, dest, [1])
    resumed = stage(nas, dest, [1])
    assert (found["action"], resumed.status) == ("resume", "resumed")
    assert found["bytes"] == resumed.copied_bytes


def test_a_hand_made_copy_is_said_to_be_adopted_after_comparing_its_ranges(
    nas: Nas, tmp_path: Path
) -> None:
    dest = tmp_path / "local" / nas.filename
    hand_made_copy(nas, dest, [1])
    found = dry_run(nas, dest, [1])
    adopted = stage(nas, dest, [1])
    assert (found["action"], adopted.status) == ("adopt", "adopted")
    assert found["bytes"] == adopted.share_bytes + adopted.header_bytes
    assert "adopted after comparing" in str(found["why"])


def test_another_ranks_hand_made_copy_is_a_refusal(nas: Nas, tmp_path: Path) -> None:
    dest = tmp_path / "local" / nas.filename
    hand_made_copy(nas, dest, [2])
    found = dry_run(nas, dest, [1])
    assert found["action"] == "refuse"
    assert "[wrong_rank]" in str(found["why"])
    assert "rank 2" in str(found["why"])


def test_a_missing_source_is_a_refusal_not_a_failed_preview(nas: Nas, tmp_path: Path) -> None:
    dest = tmp_path / "local" / "nope.safetensors"
    [shard] = engram_dry_run(
        LocalNode(),
        "node-test",
        nas_hf_cache=str(nas.hf_cache),
        stages=[engram_stage(REPO, "nope.safetensors", dest, [1])],
        composed_root=None,
    )
    assert shard["action"] == "refuse"
    assert "[missing_source]" in str(shard["why"])
