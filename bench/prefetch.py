"""Benchmark of sparkdeploy.steps.prefetch against the lab hub on loopback.

The hub runs as its own process (`python -m lab.hub`), so it does not share this process's GIL
with the clients being measured; its fault switches and byte counter are used over HTTP. As the
real hub does, it redirects every LFS file to its storage host (another port): both the plain
download and the prefetch follow that redirect.

1. Cold prefetch of a multi-file repo (default 1 GiB) vs a plain parallel download of the same
   files from the same server with the same number of connections (http.client threads):
   ratio = plain time / prefetch time (target >= 0.8). Each is run --rounds times, alternating,
   into fresh directories; the best time of each is compared.
   The plain download leaves its bytes dirty in the page cache; the prefetch puts them on disk
   and out of the cache (fdatasync + DONTNEED per file: unified memory) and hashes every byte.
   So a second reference, "plain durable", is the plain download plus the same fdatasync and
   DONTNEED per file; its ratio shows what the prefetch costs beyond what the disk costs.
   And "sha256 alone" hashes as many bytes in memory over the same number of threads: plain /
   that is the best ratio a prefetch that verifies every byte can reach on this host's cores.
   And what the seeds' operators ran before, `hf download` (huggingface_hub's snapshot_download,
   max_workers = --connections, 8 as `hf download` by default) into a fresh HF cache, then an
   fsync of each file it wrote, so that its bytes too end durable on disk:
   ratio = (snapshot_download + fsync) time / prefetch time, best of each.
2. Warm re-run: bytes the hub served (target 0) and the time it took.
3. The first prefetch into the last round's snapshot_download cache (dropped from the page cache
   first), as a first deploy on a cluster the old launcher ran does: it adopts the files by
   hashing each once (bytes hashed, seconds, hub bytes served: target 0); then a re-run, which
   recognises them by their manifest.
4. A shard removed and the hub cutting its download mid-way: bytes fetched again vs the part
   that was missing after the cut (target: ratio 1, the cut resumes at its exact byte).

    .venv/bin/python -m bench.prefetch [--gib 1.0] [--shards 8] [--connections 8]
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote, urlsplit

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.utils.tqdm import disable_progress_bars

from bench.cpu import CpuUsage, measured
from lab.hub.control import HubControl
from lab.tinymodel import generate_repo
from sparkdeploy.steps.prefetch import HubAccess, Progress, RepoSpec, prefetch
from sparkdeploy.units import human_bytes

REPO = "bench-org/big"
READ_CHUNK = 1 << 20


def plain_download(
    url: str, sha: str, files: list[str], dest: Path, connections: int, *, durable: bool
) -> None:
    """GET every file over `connections` threads, each with one keep-alive HTTP/1.1 connection
    to the hub and one to the storage host its redirects name.

    durable: each file is fdatasync'ed and dropped from the page cache once written.
    """
    queue = list(files)

    def worker() -> None:
        open_connections: dict[tuple[str, int], http.client.HTTPConnection] = {}

        def get(target: str) -> http.client.HTTPResponse:
            parts = urlsplit(target)
            origin = (parts.hostname or "127.0.0.1", parts.port or 80)
            if origin not in open_connections:
                open_connections[origin] = http.client.HTTPConnection(*origin, timeout=60)
            conn = open_connections[origin]
            conn.request("GET", f"{parts.path}?{parts.query}" if parts.query else parts.path)
            return conn.getresponse()

        try:
            while queue:
                try:
                    entry = queue.pop()
                except IndexError:
                    return
                response = get(f"{url}/{REPO}/resolve/{sha}/{quote(entry)}")
                if response.status == 302:
                    response.read()
                    response = get(response.getheader("Location") or "")
                if response.status != 200:
                    raise RuntimeError(f"{entry}: HTTP {response.status}")
                target = dest / entry
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "wb") as out:
                    while chunk := response.read(READ_CHUNK):
                        out.write(chunk)
                    if durable:
                        out.flush()
                        os.fdatasync(out.fileno())
                        os.posix_fadvise(out.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            for conn in open_connections.values():
                conn.close()

    with ThreadPoolExecutor(max_workers=connections) as pool:
        for future in [pool.submit(worker) for _ in range(connections)]:
            future.result()


def snapshot_download_durable(url: str, cache_dir: Path, workers: int) -> None:
    """`hf download REPO --cache-dir cache_dir`, then every file it wrote fsync'ed."""
    snapshot_download(REPO, cache_dir=cache_dir, endpoint=url, token=False, max_workers=workers)
    for path in regular_files(cache_dir):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def regular_files(top: Path) -> list[Path]:
    """The files under top, not the snapshot's symlinks to them."""
    return [
        Path(directory) / name
        for directory, _subdirs, names in os.walk(top)
        for name in names
        if (Path(directory) / name).is_file() and not (Path(directory) / name).is_symlink()
    ]


def drop_from_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Messages:
    """A PrefetchObserver that keeps the prefetch's messages (its log)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def on_progress(self, progress: Progress) -> None:
        pass

    def on_message(self, message: str) -> None:
        self.lines.append(message)


def sha256_alone(total: int, threads: int) -> CpuUsage:
    """What it costs to sha256 `total` bytes held in memory, split over `threads` threads."""
    block = os.urandom(READ_CHUNK)
    per_thread = total // threads // READ_CHUNK

    def work(_: int) -> None:
        digest = hashlib.sha256()
        for _ in range(per_thread):
            digest.update(block)

    with measured() as usage, ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(work, range(threads)))
    return usage


@contextmanager
def hub_process(repos: Path) -> Iterator[HubControl]:
    argv = [sys.executable, "-m", "lab.hub", "--repos", str(repos), "--host", "127.0.0.1"]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        ready = json.loads(child.stdout.readline())
        yield HubControl(ready["url"])
    finally:
        child.terminate()
        child.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="repo size (dense weights)")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    disable_progress_bars()  # snapshot_download's tqdm bars on stderr

    work = Path(tempfile.mkdtemp(prefix="bench-prefetch-"))
    try:
        repos = work / "repos"
        generated = generate_repo(
            repos, REPO, num_shards=args.shards, total_bytes=int(args.gib * (1 << 30))
        )
        total = generated.total_bytes
        with hub_process(repos) as hub:
            api = HfApi(endpoint=hub.url, token=False)
            info = api.model_info(REPO, timeout=600)  # the hub hashes the repo now, untimed
            sha = info.sha or ""
            files = [sibling.rfilename for sibling in info.siblings or []]
            access = HubAccess(hub.url, max_workers=args.connections)
            print(
                f"repo {REPO}: {len(files)} files, {human_bytes(total)}; "
                f"{args.connections} connections; loopback {hub.url}"
            )

            plain: list[CpuUsage] = []
            durable: list[CpuUsage] = []
            prefetched: list[CpuUsage] = []
            hf_downloads: list[CpuUsage] = []
            for round_no in range(args.rounds):
                for is_durable, runs in ((False, plain), (True, durable)):
                    dest = work / f"plain-{round_no}"
                    with measured() as usage:
                        plain_download(
                            hub.url, sha, files, dest, args.connections, durable=is_durable
                        )
                    runs.append(usage)
                    shutil.rmtree(dest)

                hf_cache = work / f"hf-cache-{round_no}"
                with measured() as usage:
                    snapshot_download_durable(hub.url, hf_cache, args.connections)
                hf_downloads.append(usage)
                if round_no < args.rounds - 1:
                    shutil.rmtree(hf_cache)

                nas = work / f"nas-{round_no}"
                nas.mkdir()
                with measured() as usage:
                    [outcome] = prefetch([RepoSpec(REPO)], nas, access)
                prefetched.append(usage)
                assert outcome.fetched_bytes == total
                if round_no < args.rounds - 1:
                    shutil.rmtree(nas)
            best_plain, best_durable, best_hf, best_prefetch = (
                min(runs, key=lambda usage: usage.wall_s)
                for runs in (plain, durable, hf_downloads, prefetched)
            )
            hashing = min(
                (sha256_alone(total, args.connections) for _ in range(args.rounds)),
                key=lambda usage: usage.wall_s,
            )
            cores = os.cpu_count() or 1
            # A prefetch that verifies every byte and leaves them on disk, out of the page cache,
            # needs at least the plain download's CPU plus the hashing's, spread over every core,
            # and at least the time the disk takes to take the bytes (the durable plain run).
            floor_s = max(best_durable.wall_s, (best_plain.busy_s + hashing.busy_s) / cores)
            for label, usage in (
                ("plain", best_plain),
                ("plain durable", best_durable),
                (f"snapshot_download (max_workers={args.connections}) + fsync", best_hf),
                ("prefetch (hashed, durable, out of page cache)", best_prefetch),
            ):
                print(
                    f"cold {label}: {usage.wall_s:.2f} s ({human_bytes(total / usage.wall_s)}/s),"
                    f" CPU {usage.busy_s:.2f} s ({usage.top(3)})"
                )
            print(
                f"cold ratio plain/prefetch = {best_plain.wall_s / best_prefetch.wall_s:.2f}"
                f" (target >= 0.80); plain durable/prefetch ="
                f" {best_durable.wall_s / best_prefetch.wall_s:.2f}\n"
                f"cold ratio (snapshot_download + fsync)/prefetch ="
                f" {best_hf.wall_s / best_prefetch.wall_s:.2f} (all rounds, s: snapshot_download"
                f" + fsync {', '.join(f'{usage.wall_s:.2f}' for usage in hf_downloads)};"
                f" prefetch {', '.join(f'{usage.wall_s:.2f}' for usage in prefetched)})\n"
                f"sha256 of {human_bytes(total)} alone: {hashing.wall_s:.2f} s, CPU"
                f" {hashing.busy_s:.2f} s; on this host no verifying, durable prefetch beats"
                f" {floor_s:.2f} s, so plain/prefetch <= {best_plain.wall_s / floor_s:.2f}"
                f" (disk: plain/plain durable = {best_plain.wall_s / best_durable.wall_s:.2f};"
                f" CPU over {cores} cores: {cores * best_plain.wall_s:.2f} s available in the"
                f" plain run's time, {best_plain.busy_s + hashing.busy_s:.2f} s needed)"
            )

            hub.reset_stats()
            started = time.perf_counter()
            [warm] = prefetch([RepoSpec(REPO)], nas, access)
            warm_s = time.perf_counter() - started
            stats = hub.stats()
            requests, served = stats["requests"], stats["bytes_served"]
            print(
                f"warm: hub served {served} bytes (target 0), "
                f"{requests} request(s), {warm_s * 1000:.0f} ms"
            )

            adopted_files = regular_files(hf_cache)
            drop_from_cache(adopted_files)
            log = Messages()
            hub.reset_stats()
            with measured() as usage:
                [adopted] = prefetch([RepoSpec(REPO)], hf_cache, access, observer=log)
            served = hub.stats()["bytes_served"]
            assert adopted.fetched_bytes == 0, adopted
            started = time.perf_counter()
            prefetch([RepoSpec(REPO)], hf_cache, access)
            recognised_s = time.perf_counter() - started
            [hashed_line] = [line for line in log.lines if ": hashed " in line]
            print(
                f"first adoption of the snapshot_download cache (cold): {usage.wall_s:.2f} s for"
                f" {human_bytes(adopted.total_bytes)} hashed ({adopted.total_bytes} bytes,"
                f" {human_bytes(adopted.total_bytes / usage.wall_s)}/s), CPU {usage.busy_s:.2f} s;"
                f" hub served {served} bytes (target 0); then recognised in"
                f" {recognised_s * 1000:.1f} ms\nits log: {hashed_line}"
            )

            shard = max(warm.files, key=lambda f: f.size)
            pointer = Path(warm.snapshot_dir) / shard.path
            pointer.resolve().unlink()
            pointer.unlink()
            cut = shard.size // 2 + 12345  # not on a chunk boundary
            hub.reset_stats()
            hub.set_faults(cut_next_file=cut)
            [resumed] = prefetch([RepoSpec(REPO)], nas, access)
            assert [f.path for f in resumed.files if f.fetched] == [shard.path]
            refetched = hub.stats()["bytes_served"] - cut
            missing = shard.size - cut
            print(
                f"cut: {shard.path} ({human_bytes(shard.size)}) cut after {cut} bytes; the "
                f"retry fetched {refetched} bytes for a missing part of {missing} bytes: "
                f"cut refetch ratio {refetched / missing:.3f} (target 1.000)"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
