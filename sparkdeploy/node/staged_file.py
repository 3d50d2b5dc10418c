"""What the node scripts that put a recipe's local files in place share (standard library +
sparkdeploy.errors): sparkdeploy.node.engram_copy (Engram sparse copies) and
sparkdeploy.node.plain_copy (plain files whole).

Both keep a file's work beside it under the same names (DEST.partial, DEST.manifest.json, which
sparkdeploy.node.prune knows too), write their JSON atomically, and answer the step with JSON
lines on stdout: a deliberate failure, a StagingError on the node, as {"ok": false, "kind",
"message", "dest"} with exit status FAILED_EXIT.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat as stat_mode
from collections.abc import Iterator
from typing import Any

from sparkdeploy.errors import StagingError

FAILED_EXIT = 3
PARTIAL_SUFFIX = ".partial"
MANIFEST_SUFFIX = ".manifest.json"


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as json_file:
            data = json.load(json_file)
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: str, data: dict[str, Any]) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as json_file:
        json.dump(data, json_file, indent=1)
    os.replace(temporary, path)


def still_describes(manifest: dict[str, Any], dest: str) -> bool:
    """Whether DEST is still the file its manifest recorded (same size and mtime), so it is
    trusted without reading it again; False when DEST is gone."""
    try:
        stat = os.stat(dest)
    except FileNotFoundError:
        return False
    recorded = manifest.get("dest", {})
    return (stat.st_size, stat.st_mtime_ns) == (recorded.get("size"), recorded.get("mtime_ns"))


def remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def same_inode_under(top: str, stat: os.stat_result) -> list[str]:
    """The paths under top that are hard links to the file of this stat (symlinks not
    followed; composed dirs are small trees of symlinks and a few links)."""
    found = []
    for directory, _subdirs, files in os.walk(top):
        for name in files:
            path = os.path.join(directory, name)
            try:
                entry = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat_mode.S_ISREG(entry.st_mode) and (entry.st_dev, entry.st_ino) == (
                stat.st_dev,
                stat.st_ino,
            ):
                found.append(path)
    return sorted(found)


@contextlib.contextmanager
def about(dest: str, disk_full: str) -> Iterator[None]:
    """Failures inside name the file they are about; an OSError becomes an "io" failure, or a
    "no_space" one whose message goes on with `disk_full` (what to do about it)."""
    try:
        yield
    except StagingError as failure:
        failure.dest = failure.dest or dest
        raise
    except OSError as exc:
        where = f"{exc.filename or dest}: {exc.strerror or exc}"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StagingError(f"{where}: {disk_full}", kind="no_space", dest=dest) from exc
        raise StagingError(where, kind="io", dest=dest) from exc


def emit(line: dict[str, Any]) -> None:
    """One JSON line of the script's answer, on stdout at once."""
    print(json.dumps(line), flush=True)


def failure_answer(failure: StagingError) -> dict[str, Any]:
    return {"ok": False, "kind": failure.kind, "message": str(failure), "dest": failure.dest}
