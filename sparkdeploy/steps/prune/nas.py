"""The NAS side of a prune: each repo's revisions (with the blobs only they link) and partial
downloads in the HF cache decided, and removed under the repo's prefetch lock."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

from sparkdeploy.errors import PrefetchError
from sparkdeploy.node import prune as node_prune
from sparkdeploy.steps.prefetch.cache import MANIFEST_DIRNAME, PARTIAL_SUFFIX
from sparkdeploy.steps.prefetch.lock import repo_lock
from sparkdeploy.steps.prefetch.progress import SilentObserver
from sparkdeploy.steps.prune.in_use import InUse
from sparkdeploy.steps.prune.rows import (
    KEPT,
    NAS,
    REMOVED,
    WOULD_REMOVE,
    Candidate,
    Log,
    PruneRow,
    hours,
)
from sparkdeploy.units import human_bytes

# A partial download this old belongs to a prefetch that died (a live one writes every second,
# and one retried by its task resumes within minutes).
PARTIAL_MIN_AGE_HOURS = 24


def _disk_bytes(path: Path) -> int:
    try:
        return node_prune.disk_bytes(path.lstat())
    except FileNotFoundError:
        return 0


def _tree(root: Path) -> Iterator[Path]:
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            yield Path(directory, name)


def _blobs_of(snapshot: Path, blobs: Path) -> set[str]:
    """The blobs a snapshot's symlinks point at."""
    found = set()
    for entry in _tree(snapshot):
        if entry.is_symlink():
            target = Path(os.path.normpath(entry.parent / os.readlink(entry)))
            if target.parent == blobs:
                found.add(target.name)
    return found


def decide_repo(
    storage: Path, repo: str, in_use: InUse, now: float, min_age_s: float
) -> list[Candidate]:
    """What of one repo's NAS cache dir may go, and why: revisions with the blobs only they
    link, partial downloads."""
    snapshots_dir, blobs = storage / "snapshots", storage / "blobs"
    snapshots = sorted(p for p in snapshots_dir.glob("*") if p.is_dir() and not p.is_symlink())
    refs = {
        ref: ref.read_text().strip()
        for ref in (_tree(storage / "refs") if (storage / "refs").is_dir() else [])
        if ref.is_file()
    }
    decided: list[tuple[Path, str | None]] = []
    for snapshot in snapshots:
        sha, age = snapshot.name, now - snapshot.stat().st_mtime
        why: str | None = in_use.nas_keep_repo.get(repo) or in_use.nas_keep.get(repo, {}).get(sha)
        if why is None and age < min_age_s:
            why = f"made {hours(age)} ago, newer than {hours(min_age_s)}"
        decided.append((snapshot, why))
    kept_blobs = set().union(*(_blobs_of(s, blobs) for s, why in decided if why is not None))
    claimed: set[str] = set()
    found = []
    for snapshot, why in decided:
        sha = snapshot.name
        if why is not None:
            found.append(Candidate("revision", NAS, str(snapshot), 0, False, why))
            continue
        linked = _blobs_of(snapshot, blobs)
        own = sorted(linked - kept_blobs - claimed)
        claimed.update(own)
        naming = sorted(str(ref.relative_to(storage)) for ref, to in refs.items() if to == sha)
        paths = (
            snapshot,
            *(blobs / blob for blob in own),
            storage / MANIFEST_DIRNAME / f"{sha}.json",
            storage / "trees" / f"{sha}.json",
            *(storage / ref for ref in naming),
        )
        size = sum(_disk_bytes(p) for p in paths[1:]) + sum(
            _disk_bytes(entry) for entry in [snapshot, *_tree(snapshot)]
        )
        shared = len(linked) - len(own)
        why = (
            f"{repo}: no recipe or running deployment names it; made"
            f" {hours(now - snapshot.stat().st_mtime)} ago"
            + (f"; {shared} blob(s) linked by another revision stay" if shared else "")
            + (f"; {', '.join(naming)} named it" if naming else "")
        )
        found.append(Candidate("revision", NAS, str(snapshot), size, True, why, paths=paths))
    partial_age_s = PARTIAL_MIN_AGE_HOURS * 3600
    for partial in sorted(blobs.glob(f"*{PARTIAL_SUFFIX}")):
        age = now - partial.stat().st_mtime
        remove = age >= partial_age_s
        why = f"{repo}: partial download untouched for {hours(age)}" + (
            "" if remove else f", less than {PARTIAL_MIN_AGE_HOURS} h: a prefetch may resume it"
        )
        found.append(
            Candidate(
                "partial download",
                NAS,
                str(partial),
                _disk_bytes(partial),
                remove,
                why,
                paths=(partial,),
            )
        )
    return found


def _remove_paths(paths: Sequence[Path]) -> None:
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _repo_name(storage: Path) -> str:
    """models--org--name -> org/name."""
    return storage.name.removeprefix("models--").replace("--", "/")


def prune_nas(
    cache_dir: Path, in_use: InUse, now: float, min_age_s: float, *, dry_run: bool, log: Log
) -> list[PruneRow]:
    """Every repo of the NAS cache decided; in a real run each repo's decision is made and
    carried out under its prefetch lock, and a repo whose lock a prefetch holds is left."""
    if in_use.nas_doubt is not None:
        return [PruneRow("NAS", NAS, str(cache_dir), 0, KEPT, in_use.nas_doubt)]
    rows: list[PruneRow] = []
    for storage in sorted(cache_dir.glob("models--*")):
        repo = _repo_name(storage)
        if dry_run:
            candidates = decide_repo(storage, repo, in_use, now, min_age_s)
            rows += [c.row(WOULD_REMOVE if c.remove else KEPT) for c in candidates]
            continue
        try:
            with repo_lock(storage, repo, wait_s=0, observer=SilentObserver()):
                candidates = decide_repo(storage, repo, in_use, now, min_age_s)
                for c in candidates:
                    if c.remove:
                        _remove_paths(c.paths)
                        log(f"NAS: removed {c.path} ({human_bytes(c.bytes)}): {c.why}")
                rows += [c.row(REMOVED if c.remove else KEPT) for c in candidates]
        except PrefetchError as error:
            rows.append(PruneRow("repo", NAS, str(storage), 0, KEPT, f"{repo}: {error}"))
    return rows
