"""Benchmark: adopting a hand-made Engram copy (issue 22) against reading the same bytes.

A ~1 GiB synthetic Engram shard is put in an HF cache laid out as the NAS holds it
(lab/testing/hfcache_layout.py), and a copy of rank 0 of TP 3 is made by hand as the old launcher
left it: a file truncated to the shard's size, the header and the rank's row ranges written at
their offsets with pwrite, holes elsewhere, no manifest of ours. The adoption is the node
script's stage_all (sparkdeploy.node.engram_copy) called in this process for that dest, the
whole call timed: plan, size and header checks, the full compare of every byte of the ranges in
both files (which also hashes the source's ranges for the manifest), the hole check, the
manifest. Its manifest is removed after each round so the next round adopts again.

The reference reads exactly the bytes the compare reads: the ranges of the NAS shard, then the
same ranges of the copy, each range by `dd bs=128K iflag=skip_bytes,count_bytes of=/dev/null`
(what `cat FILE > /dev/null` does, 128 KiB reads, but of the ranges only; sequentially, one
file after the other). ratio = reference / adoption (target >= 0.80). For scale, `cat shard >
/dev/null; cat copy > /dev/null` of the whole files is timed too: it reads the other ranks'
rows of the shard and the copy's holes as well, so it is no measure of the compare.

Every timed run starts cold for these two files: each is fdatasync'ed and dropped from the page
cache (POSIX_FADV_DONTNEED), and util-linux `fincore` confirms nothing of them is resident. A
global drop (writing /proc/sys/vm/drop_caches) is not used, writable or not: it would take other
work's pages on this shared machine, and with them its timings. Each of the three runs ROUNDS
times, in turn; the best time of each is compared. The compare overlaps its reads with sha256
of the source's bytes, so sha256 of the share in memory is timed too: when it exceeds the
reference, it, not the compare's reads, bounds the ratio on this host.

    .venv/bin/python -m bench.adopt [--dir /var/tmp/sparkdeploy-bench-adopt] [--size 1GiB]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cpu import measured
from lab.testing.hfcache_layout import cache_repo
from lab.testing.page_cache import drop_from_cache, resident_bytes
from lab.tinymodel import EngramSpec, generate_repo, parse_size
from sparkdeploy.node import engram_copy, engram_plan
from sparkdeploy.node.staged_file import MANIFEST_SUFFIX
from sparkdeploy.units import human_bytes

REPO = "bench-org/EngramAdopt"
TP = 3
RANK = 0
ROUNDS = 5
COPY_CHUNK = 16 * 1024 * 1024
# cat's read size (coreutils io_blksize: 128 KiB on a filesystem reporting 4 KiB blocks).
READ_BLOCK = "128K"


@dataclass(frozen=True, order=True)
class Run:
    """One timed run (ordered by wall time); own_cpu_s is its own processes' CPU, busy_s the
    whole machine's (other work included), stolen_s what the hypervisor withheld."""

    wall_s: float
    own_cpu_s: float
    busy_s: float
    stolen_s: float


def timed(body: Callable[[], None]) -> Run:
    own = own_cpu_s()
    with measured() as usage:
        body()
    return Run(usage.wall_s, own_cpu_s() - own, usage.busy_s, usage.stolen_s)


def cold(*paths: Path) -> None:
    for path in paths:
        drop_from_cache(path)
    left = resident_bytes(*paths)
    if left:
        raise RuntimeError(f"{left} bytes of {paths} still in the page cache after DONTNEED")


def hand_made_copy(source: Path, dest: Path, ranges: list[tuple[int, int]]) -> None:
    """What the old launcher left: the ranges at their offsets in a file of the source's size,
    holes elsewhere (as tests/test_stage_engram_adopt.py makes one, in chunks)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    src = os.open(source, os.O_RDONLY)
    dst = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(dst, os.fstat(src).st_size)
        for begin, end in ranges:
            for offset in range(begin, end, COPY_CHUNK):
                data = os.pread(src, min(COPY_CHUNK, end - offset), offset)
                os.pwrite(dst, data, offset)
        os.fsync(dst)
    finally:
        os.close(src)
        os.close(dst)


def read_ranges(paths: list[Path], ranges: list[tuple[int, int]]) -> None:
    """The reference: each file's ranges read to /dev/null, as cat reads, one after the other."""
    for path in paths:
        for begin, end in ranges:
            subprocess.run(
                [
                    "dd",
                    f"if={path}",
                    "of=/dev/null",
                    f"bs={READ_BLOCK}",
                    "iflag=skip_bytes,count_bytes",
                    f"skip={begin}",
                    f"count={end - begin}",
                    "status=none",
                ],
                check=True,
                timeout=600,
            )


def cat_whole(paths: list[Path]) -> None:
    for path in paths:
        with open(os.devnull, "wb") as sink:
            subprocess.run(["cat", str(path)], stdout=sink, check=True, timeout=600)


def own_cpu_s() -> float:
    """CPU seconds of this process and its waited-for children (dd, cat): what a run cost
    itself, apart from the other work on the machine that the busy figure includes."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def sha256_alone(total: int) -> float:
    """Seconds to sha256 `total` bytes held in memory, in one thread as the compare hashes."""
    block = os.urandom(engram_plan.DEFAULT_CHUNK_BYTES)
    digest = hashlib.sha256()
    started = time.monotonic()
    for _ in range(-(-total // len(block))):
        digest.update(block)
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp/sparkdeploy-bench-adopt"))
    parser.add_argument("--size", type=parse_size, default=parse_size("1GiB"), help="the shard")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    work: Path = args.dir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        spec = EngramSpec.for_table_bytes(args.size, layer_ids=(1,), n_heads=3, head_dim=256)
        repo = generate_repo(work / "repos", REPO, engram=spec, tp_size=TP, total_bytes=4096)
        filename = repo.engram_shards[1]
        snapshot = cache_repo(repo, work / "nas")
        source = (snapshot / filename).resolve()
        dest = work / "node" / filename
        request = engram_plan.Request(
            node="bench",
            nas_hf_cache=str(work / "nas"),
            repo=REPO,
            revision=None,
            filename=filename,
            dest=str(dest),
            ranks=(RANK,),
            tp_size=TP,
        )
        ranges = engram_plan.plan_copy(request).ranges
        hand_made_copy(source, dest, ranges)
        compared = sum(end - begin for begin, end in ranges)
        size = source.stat().st_size
        drop_caches = "" if os.access("/proc/sys/vm/drop_caches", os.W_OK) else "not "
        print(
            f"shard {filename}: {human_bytes(size)}; hand-made copy of rank {RANK} of TP {TP}:"
            f" {len(ranges)} ranges, {human_bytes(compared)}, allocated"
            f" {human_bytes(dest.stat().st_blocks * 512)}; disk of {work}; best of"
            f" {args.rounds} rounds, each run cold (fdatasync + DONTNEED per file, fincore 0;"
            f" /proc/sys/vm/drop_caches {drop_caches}writable, not used)"
        )
        print(
            f"the compare reads {human_bytes(compared)} of the shard and the same ranges of the"
            f" copy, {human_bytes(2 * compared)} in all; the reference reads exactly those with"
            f" dd bs={READ_BLOCK}; cat of both whole files reads {human_bytes(2 * size)}"
            " (the copy's holes without the disk)"
        )

        results: list[dict[str, Any]] = []

        def adoption() -> None:
            lines: list[dict[str, Any]] = []
            engram_copy.stage_all([request], lines.append)
            [result] = [line["result"] for line in lines if "result" in line]
            assert result["status"] == "adopted", result
            assert result["holes_checked"], result
            assert result["note"] is None, result
            results.append(result)
            # The next round adopts again.
            Path(f"{dest}{MANIFEST_SUFFIX}").unlink()

        runs: dict[str, tuple[Callable[[], None], int, list[Run]]] = {
            "reference (dd of the ranges, both files)": (
                lambda: read_ranges([source, dest], ranges),
                2 * compared,
                [],
            ),
            "cat of both whole files": (lambda: cat_whole([source, dest]), 2 * size, []),
            "adoption (stage_all: compare + manifest)": (adoption, 2 * compared, []),
        }
        for _ in range(args.rounds):
            for body, _read, timings in runs.values():
                cold(source, dest)
                timings.append(timed(body))
        best = {label: min(timings) for label, (_body, _read, timings) in runs.items()}
        hashing_s = min(sha256_alone(compared) for _ in range(args.rounds))
        print(
            "run                                       best s  MiB/s  own CPU s  machine busy s"
            "  stolen s  all rounds, s"
        )
        for label, (_body, read, timings) in runs.items():
            run = best[label]
            print(
                f"{label:<41} {run.wall_s:6.2f}  {read / run.wall_s / 2**20:5.0f}"
                f"  {run.own_cpu_s:9.2f}  {run.busy_s:14.2f}  {run.stolen_s:8.2f}  "
                + ", ".join(f"{timing.wall_s:.2f}" for timing in timings)
            )
        reference, whole, adopted = best.values()
        print(
            "the node script's own seconds per adoption: "
            + ", ".join(f"{result['seconds']:.2f}" for result in results)
        )
        bound = reference.wall_s / max(reference.wall_s, hashing_s)
        print(
            f"ratio reference/adoption = {reference.wall_s / adopted.wall_s:.2f}"
            f" (target >= 0.80); cat whole/adoption = {whole.wall_s / adopted.wall_s:.2f}\n"
            f"sha256 of {human_bytes(compared)} alone, one thread: {hashing_s:.2f} s; the compare"
            f" hashes while it reads, so on this host reference/adoption <= {bound:.2f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
