"""The tiny-model generator: deterministic content, real safetensors headers, Engram shards."""

import hashlib
import json
import os
from pathlib import Path

import pytest

from lab.hub.index import index_repo
from lab.tinymodel import (
    BLOCK_BYTES,
    EngramSpec,
    first_mismatch,
    generate_repo,
    iter_tensor_bytes,
    main,
    parse_size,
    row_bytes,
    tensor_bytes,
    write_tensor_bytes,
)
from sparkdeploy.node.engram import EngramGeometry, rank_byte_ranges, read_safetensors_header

WEIGHT = "layers.1.engram.embed.weight"
SCALE = "layers.1.engram.embed.scale"


def test_rows_are_deterministic_and_differ_between_rows_and_tensors() -> None:
    assert row_bytes(WEIGHT, 7, 64) == row_bytes(WEIGHT, 7, 64)
    rows = {row_bytes(WEIGHT, row, 64) for row in range(5000)}
    assert len(rows) == 5000
    assert row_bytes(WEIGHT, 7, 64) != row_bytes(SCALE, 7, 64)
    assert tensor_bytes(WEIGHT, 0, 4096) != tensor_bytes(SCALE, 0, 4096)


def test_no_row_is_all_zeros_even_two_bytes_wide() -> None:
    assert all(any(row_bytes(SCALE, row, 2)) for row in range(20000))


def test_chunks_across_block_boundaries_agree_with_rows() -> None:
    start, stop = BLOCK_BYTES - 100, 3 * BLOCK_BYTES + 50
    chunks = list(iter_tensor_bytes(WEIGHT, start, stop))
    assert all(len(chunk) <= BLOCK_BYTES for chunk in chunks)
    joined = b"".join(chunks)
    assert len(joined) == stop - start
    width = 66
    row = BLOCK_BYTES // width  # a row that straddles the first block boundary
    assert joined[row * width - start : (row + 1) * width - start] == row_bytes(WEIGHT, row, width)
    # Blocks are not copies of each other.
    assert tensor_bytes(WEIGHT, 0, 4096) != tensor_bytes(WEIGHT, BLOCK_BYTES, BLOCK_BYTES + 4096)


def test_engram_spec_uses_the_prime_rule() -> None:
    keys = EngramSpec().config_keys()
    # vocab 1000, 2 heads, orders 2 and 3: primes 1009 1013 1019 1021 | 1031 1033 1039 1049.
    assert keys["engram_num_embeddings"] == [4062, 4152]
    sized = EngramSpec.for_table_bytes(64 * 1024 * 1024, n_heads=3)
    rows = sized.config_keys()["engram_num_embeddings"][0]
    assert abs(rows * sized.row_bytes - 64 * 1024 * 1024) < 0.01 * 64 * 1024 * 1024


def test_generated_repo_has_real_headers_and_engram_shards(tmp_path: Path) -> None:
    repo = generate_repo(
        tmp_path, "lab/tiny", num_shards=3, total_bytes=300_000, engram=EngramSpec()
    )
    assert repo.path == tmp_path / "lab" / "tiny"
    assert sorted(p.name for p in repo.path.iterdir()) == list(repo.files)
    assert len(repo.shards) == 5
    assert repo.engram_shards == {
        1: "model-00004-of-00005.safetensors",
        3: "model-00005-of-00005.safetensors",
    }
    index = json.loads((repo.path / "model.safetensors.index.json").read_text())
    tensors_by_shard: dict[str, set[str]] = {}
    for tensor, shard in index["weight_map"].items():
        tensors_by_shard.setdefault(shard, set()).add(tensor)
    data_bytes = 0
    dense_bytes = 0
    for shard in repo.shards:
        header_len, tensors, metadata = read_safetensors_header(repo.path / shard)
        assert (8 + header_len) % 8 == 0
        assert metadata == {"format": "pt", "lab_revision": "1"}
        assert set(tensors) == tensors_by_shard[shard]
        assert max(t.end for t in tensors.values()) == (repo.path / shard).stat().st_size
        data_bytes += sum(t.end - t.begin for t in tensors.values())
        if shard in repo.shards[:3]:
            dense_bytes += sum(t.end - t.begin for t in tensors.values())
    assert index["metadata"]["total_size"] == data_bytes
    assert 300_000 - 1024 < dense_bytes <= 300_000  # whole 1 KiB rows

    config = json.loads((repo.path / "config.json").read_text())
    geometry = EngramGeometry.from_config(config)
    assert geometry is not None
    assert [sum(c) for c in geometry.column_sizes()] == list(geometry.num_embeddings)
    _, tensors, _ = read_safetensors_header(repo.path / repo.engram_shards[3])
    assert set(tensors) == {"layers.3.engram.embed.weight", "layers.3.engram.embed.scale"}
    assert rank_byte_ranges(tensors, geometry, [0, 1], 2)


def test_file_content_is_the_row_content(tmp_path: Path) -> None:
    repo = generate_repo(tmp_path, "lab/tiny", engram=EngramSpec())
    shard = repo.path / repo.engram_shards[1]
    _, tensors, _ = read_safetensors_header(shard)
    weight, scale = tensors[WEIGHT], tensors[SCALE]
    with open(shard, "rb") as handle:
        fd = handle.fileno()
        for info in (weight, scale):
            width = info.row_width
            for row in (0, 1, 2000, info.shape[0] - 1):
                assert os.pread(fd, width, info.begin + row * width) == row_bytes(
                    info.name, row, width
                )
            assert first_mismatch(fd, info.begin, info.name, 0, info.end - info.begin) is None
        # Another tensor's content, or this tensor's content at another offset, is caught.
        assert first_mismatch(fd, weight.begin, SCALE, 0, 1000) == 0
        assert first_mismatch(fd, weight.begin + 64, WEIGHT, 0, 1000) == 0


def test_bulk_writer_writes_a_row_range_in_place(tmp_path: Path) -> None:
    path = tmp_path / "sparse"
    width, first, last = 66, 20_000, 40_000
    with open(path, "w+b") as handle:
        os.truncate(handle.fileno(), 4096 + 50_000 * width)
        digest = hashlib.sha256()
        write_tensor_bytes(handle.fileno(), 4096, WEIGHT, first * width, last * width, digest)
        fd = handle.fileno()
        assert first_mismatch(fd, 4096, WEIGHT, first * width, last * width) is None
        assert os.pread(fd, width, 4096 + first * width) == row_bytes(WEIGHT, first, width)
        assert not any(os.pread(fd, width, 4096 + (first - 1) * width))
        assert not any(os.pread(fd, width, 4096 + last * width))
    assert (
        digest.hexdigest()
        == hashlib.sha256(tensor_bytes(WEIGHT, first * width, last * width)).hexdigest()
    )


def test_first_mismatch_finds_a_zeroed_range_and_a_short_file(tmp_path: Path) -> None:
    repo = generate_repo(tmp_path, "lab/tiny", engram=EngramSpec())
    shard = repo.path / repo.engram_shards[1]
    _, tensors, _ = read_safetensors_header(shard)
    weight = tensors[WEIGHT]
    with open(shard, "r+b") as handle:
        os.pwrite(handle.fileno(), bytes(640), weight.begin + 100 * 64)
        assert first_mismatch(handle.fileno(), weight.begin, WEIGHT, 0, 200 * 64) == 100 * 64
        os.truncate(handle.fileno(), weight.begin + 50)
        assert first_mismatch(handle.fileno(), weight.begin, WEIGHT, 0, 64) == 50


def test_dense_holes_keep_engram_content(tmp_path: Path) -> None:
    repo = generate_repo(
        tmp_path, "lab/holes", total_bytes=4 * BLOCK_BYTES, engram=EngramSpec(), dense_holes=True
    )
    dense = repo.path / repo.shards[0]
    _, tensors, _ = read_safetensors_header(dense)
    info = next(iter(tensors.values()))
    with open(dense, "rb") as handle:
        assert not any(os.pread(handle.fileno(), 4096, info.begin))
    assert os.stat(dense).st_blocks * 512 < dense.stat().st_size // 2
    shard = repo.path / repo.engram_shards[1]
    _, tensors, _ = read_safetensors_header(shard)
    with open(shard, "rb") as handle:
        weight = tensors[WEIGHT]
        assert (
            first_mismatch(handle.fileno(), weight.begin, WEIGHT, 0, weight.end - weight.begin)
            is None
        )


def test_regeneration_replaces_the_repo_and_the_gate(tmp_path: Path) -> None:
    generate_repo(tmp_path, "lab/tiny", engram=EngramSpec(), gated_tokens=["hf_lab"])
    assert (tmp_path / "lab" / "tiny.gated").read_text() == "hf_lab\n"
    repo = generate_repo(tmp_path, "lab/tiny", revision="2")
    assert (repo.path / "model-00002-of-00002.safetensors").is_file()
    assert not (repo.path / "model-00004-of-00004.safetensors").exists()
    assert not (tmp_path / "lab" / "tiny.gated").exists()
    assert [p.name for p in (tmp_path / "lab").iterdir()] == ["tiny"]


def test_digests_computed_while_writing_are_the_real_ones(tmp_path: Path) -> None:
    repo = generate_repo(tmp_path, "lab/tiny", engram=EngramSpec())
    state = index_repo(tmp_path, "lab/tiny")
    for shard in repo.shards:
        assert (
            state.files[shard].sha256
            == hashlib.sha256((repo.path / shard).read_bytes()).hexdigest()
        )


def test_tp_hint_rejects_a_split_that_leaves_a_rank_without_rows(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="the last rank owns no rows"):
        generate_repo(tmp_path, "lab/tiny", engram=EngramSpec(n_heads=2), tp_size=3)
    generate_repo(tmp_path, "lab/tiny", engram=EngramSpec(n_heads=3), tp_size=3)


def test_bad_repo_ids_are_refused(tmp_path: Path) -> None:
    for bad in ("noslash", "a/b/c", "../x", "lab/.hidden"):
        with pytest.raises(ValueError, match="expected org/name"):
            generate_repo(tmp_path, bad)


def test_sizes_parse() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("512K") == 512 * 1024
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("2g") == 2 * 2**30


def test_cli_writes_a_repo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path), "lab/cli", "--size", "64K", "--engram", "--engram-heads", "3"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["path"] == str(tmp_path / "lab" / "cli")
    assert summary["engram_shards"] == {
        "1": "model-00003-of-00004.safetensors",
        "3": "model-00004-of-00004.safetensors",
    }
    assert summary["bytes"] == sum(p.stat().st_size for p in (tmp_path / "lab" / "cli").iterdir())
