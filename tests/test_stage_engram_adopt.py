"""Engram staging finding a copy it did not make at DEST (issue 22, item 1): made by hand or by
the old launcher, without our manifest, maybe hard-linked by other lanes.

The copies here are made by test code, not by the staging script: the header and the rank's
row ranges written with os.pwrite into a file truncated to the shard's size.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from test_stage_engram import (
    CHUNK,
    REPO,
    TP,
    Nas,
    assert_sparse_copy_of,
    engram_stage,
    make_nas,
    stage,
)

from lab.testing.local_node import LocalNode
from lab.testing.page_cache import resident_bytes
from sparkdeploy.errors import StagingError
from sparkdeploy.node.engram import (
    HEADER_LENGTH_BYTES,
    EngramGeometry,
    merge_ranges,
    rank_byte_ranges,
    read_safetensors_header,
)
from sparkdeploy.steps import stage_engram as staging


@pytest.fixture
def nas(tmp_path: Path) -> Nas:
    return make_nas(tmp_path)


def rank_ranges(nas: Nas, ranks: list[int]) -> list[tuple[int, int]]:
    """The header and the ranks' rows, as the staging plan computes them."""
    source = nas.snapshot / nas.filename
    header_len, tensors, _ = read_safetensors_header(source)
    geometry = EngramGeometry.from_config(json.loads((nas.snapshot / "config.json").read_text()))
    assert geometry is not None
    rows = rank_byte_ranges(tensors, geometry, ranks, TP)
    return merge_ranges([(0, HEADER_LENGTH_BYTES + header_len), *rows])


def hand_made_copy(nas: Nas, dest: Path, ranks: list[int], *, materialised: bool = False) -> None:
    """What the old launcher left: the ranks' bytes at their offsets, holes (or, materialised,
    written zeros) elsewhere."""
    data = (nas.snapshot / nas.filename).read_bytes()
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if materialised:
            os.pwrite(fd, bytes(len(data)), 0)
        else:
            os.ftruncate(fd, len(data))
        for begin, end in rank_ranges(nas, ranks):
            os.pwrite(fd, data[begin:end], begin)
    finally:
        os.close(fd)


def corrupt_one_row_byte(nas: Nas, dest: Path, ranks: list[int]) -> int:
    """Flip a byte in the middle of the ranks' last row range; returns its offset."""
    begin, end = rank_ranges(nas, ranks)[-1]
    offset = (begin + end) // 2
    with open(dest, "r+b") as copy:
        copy.seek(offset)
        byte = copy.read(1)
        copy.seek(offset)
        copy.write(bytes([byte[0] ^ 0xFF]))
    return offset


def snapshot_of(path: Path) -> tuple[bytes, int, int, int]:
    stat = path.stat()
    return path.read_bytes(), stat.st_ino, stat.st_mtime_ns, stat.st_nlink


def test_hand_made_sparse_copy_with_another_link_is_adopted_in_place(
    nas: Nas, tmp_path: Path
) -> None:
    dest = tmp_path / "node" / nas.filename
    hand_made_copy(nas, dest, [1])
    other_lane = tmp_path / "other-lane" / nas.filename
    other_lane.parent.mkdir()
    os.link(dest, other_lane)
    before = snapshot_of(dest)
    phases: list[str] = []

    def on_progress(node: str, dest_path: str, done: int, total: int, phase: str) -> None:
        phases.append(phase)

    (result,) = staging.stage_on_node(
        LocalNode(),
        "node-test",
        nas_hf_cache=str(nas.hf_cache),
        stages=[engram_stage(REPO, nas.filename, dest, [1])],
        chunk_bytes=CHUNK,
        on_progress=on_progress,
    )
    assert result.status == "adopted"
    assert result.copied_bytes == 0
    assert result.holes_checked
    assert result.note is None
    assert phases
    assert set(phases) == {"compare"}
    # The file itself untouched: same bytes, inode, mtime; the other lane still links it.
    assert snapshot_of(dest) == before
    assert other_lane.stat().st_ino == before[1]
    data = (nas.snapshot / nas.filename).read_bytes()
    assert list(result.range_sha256) == [
        hashlib.sha256(data[begin:end]).hexdigest() for begin, end in result.ranges
    ]
    # The manifest has the form of a copy's.
    adopted = json.loads(Path(f"{dest}.manifest.json").read_text())
    copied_dest = tmp_path / "copied" / nas.filename
    stage(nas, copied_dest, [1])
    copied = json.loads(Path(f"{copied_dest}.manifest.json").read_text())
    assert adopted.keys() == copied.keys()
    differ = {"dest", "written_at"}
    assert {k: v for k, v in adopted.items() if k not in differ} == {
        k: v for k, v in copied.items() if k not in differ
    }
    again = stage(nas, dest, [1])
    assert again.status == "skipped"
    assert snapshot_of(dest) == before


def test_hand_made_copy_of_another_rank_fails_naming_both_ranks(nas: Nas, tmp_path: Path) -> None:
    dest = tmp_path / "node" / nas.filename
    hand_made_copy(nas, dest, [2])
    before = snapshot_of(dest)
    with pytest.raises(StagingError, match=r"\[wrong_rank\]") as raised:
        stage(nas, dest, [0])
    message = str(raised.value)
    assert f"{dest} holds rank 2's rows, this plan gives node node-test rank 0 of TP 3" in message
    assert "remove or rename" in message
    assert snapshot_of(dest) == before
    assert not Path(f"{dest}.manifest.json").exists()
    assert not Path(f"{dest}.partial").exists()


def test_corrupted_copy_with_two_links_is_refused_and_left_untouched(
    nas: Nas, tmp_path: Path
) -> None:
    dest = tmp_path / "node" / nas.filename
    hand_made_copy(nas, dest, [1])
    offset = corrupt_one_row_byte(nas, dest, [1])
    os.link(dest, tmp_path / "other-lane-copy")
    before = snapshot_of(dest)
    with pytest.raises(StagingError, match=r"\[linked_mismatch\]") as raised:
        stage(nas, dest, [1])
    message = str(raised.value)
    assert f"{dest} does not match" in message
    assert f"byte {offset} " in message
    assert "has 2 hard links" in message
    assert f"remove or rename {dest} by hand" in message
    assert "[[composed_model.local_files]] host path at another path" in message
    assert snapshot_of(dest) == before
    assert not Path(f"{dest}.manifest.json").exists()
    assert not Path(f"{dest}.partial").exists()


def test_corrupted_copy_with_one_link_is_copied_again(nas: Nas, tmp_path: Path) -> None:
    dest = tmp_path / "node" / nas.filename
    hand_made_copy(nas, dest, [1])
    corrupt_one_row_byte(nas, dest, [1])
    inode = dest.stat().st_ino
    result = stage(nas, dest, [1])
    assert result.status == "copied"
    assert result.copied_bytes == result.share_bytes + result.header_bytes
    assert dest.stat().st_ino != inode  # a new file renamed over the old one
    assert_sparse_copy_of(nas.snapshot / nas.filename, dest, result.ranges)


def test_fully_materialised_correct_copy_is_adopted_with_a_note(nas: Nas, tmp_path: Path) -> None:
    """Decided: adopted as it is. The engine reads only the header and its rows, which match;
    making it sparse would mean a new file, off the other lanes' links. The note says what
    it costs."""
    dest = tmp_path / "node" / nas.filename
    hand_made_copy(nas, dest, [0], materialised=True)
    before = snapshot_of(dest)
    result = stage(nas, dest, [0])
    assert result.status == "adopted"
    assert result.copied_bytes == 0
    assert not result.holes_checked
    assert result.note is not None
    assert "fully materialised" in result.note
    assert result.allocated_bytes >= result.size
    assert snapshot_of(dest) == before
    manifest = json.loads(Path(f"{dest}.manifest.json").read_text())
    assert manifest["note"] == result.note
    assert stage(nas, dest, [0]).note == result.note  # the skipped re-run still says so


def test_adoption_leaves_neither_file_in_the_page_cache(nas: Nas, tmp_path: Path) -> None:
    """The compare reads with readahead (past the ranges' ends too) and drops what it read:
    nothing of the source or DEST stays cached, chunk boundaries and partial pages included."""
    dest = tmp_path / "node" / nas.filename
    hand_made_copy(nas, dest, [1])
    source = (nas.snapshot / nas.filename).resolve()
    for path in (source, dest):
        # Clean pages: DONTNEED drops no dirty ones. Both are cached, as just written.
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    assert resident_bytes(source) > 0
    assert resident_bytes(dest) > 0
    assert stage(nas, dest, [1]).status == "adopted"
    assert (resident_bytes(source), resident_bytes(dest)) == (0, 0)


def test_links_in_this_deployments_composed_dir_do_not_block_a_new_copy(
    nas: Nas, tmp_path: Path
) -> None:
    """Our copy of rank 0, linked by this deployment's composed dir (compose-model relinks it)
    and then by another deployment's: only the latter refuses, naming its path."""
    dest = tmp_path / "node" / nas.filename
    composed = tmp_path / "composed"
    ours = composed / "dep-ours" / "models--x" / "snapshots" / "abc" / nas.filename
    ours.parent.mkdir(parents=True)
    stage(nas, dest, [0])
    os.link(dest, ours)
    result = stage(nas, dest, [2], composed_root=composed / "dep-ours")
    assert result.status == "copied"
    assert_sparse_copy_of(nas.snapshot / nas.filename, dest, result.ranges)

    theirs = composed / "dep-theirs" / "models--x" / "snapshots" / "abc" / nas.filename
    theirs.parent.mkdir(parents=True)
    os.link(dest, theirs)
    ours.unlink()
    os.link(dest, ours)
    with pytest.raises(StagingError, match=r"\[linked_mismatch\]") as raised:
        stage(nas, dest, [1], composed_root=composed / "dep-ours")
    message = str(raised.value)
    assert "has 3 hard links" in message
    assert str(theirs) in message
    assert str(ours) not in message
