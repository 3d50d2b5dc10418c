"""What a prune found and what it did: each candidate with the reason it may go or stays, the
prune's table rows (a node's from what its removal answered) and its one-line summary."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkdeploy.units import human_bytes

REMOVED, WOULD_REMOVE, KEPT = "removed", "would remove", "kept"
NAS = "NAS"

Log = Callable[[str], None]


@dataclass(frozen=True)
class Candidate:
    """Something the prune found, and whether it may go (why, either way). `item` is what the
    node script needs to remove it (nodes), `paths` what goes with it (NAS)."""

    what: str  # composed dir, local file, revision, partial download, NAS
    where: str  # a node's name, or NAS
    path: str
    bytes: int
    remove: bool
    why: str
    item: dict[str, Any] | None = None
    paths: tuple[Path, ...] = ()

    def row(self, action: str, why: str | None = None) -> PruneRow:
        """Its row in the prune's table: what was done, and why (its own reason unless given)."""
        return PruneRow(
            self.what, self.where, self.path, self.bytes, action, self.why if why is None else why
        )


@dataclass(frozen=True)
class PruneRow:
    what: str
    where: str
    path: str
    bytes: int
    action: str  # removed, would remove, kept
    why: str

    def as_row(self) -> dict[str, str]:
        return {
            "what": self.what,
            "where": self.where,
            "path": self.path,
            "bytes": f"{human_bytes(self.bytes)} ({self.bytes})",
            "action": self.action,
            "why": self.why,
        }


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


def node_rows(
    candidates: Sequence[Candidate], answer: Mapping[str, Any] | None, *, dry_run: bool
) -> list[PruneRow]:
    """A node's rows: what the removal answered (None: nothing was asked of the node)."""
    rows = []
    for c in candidates:
        if not c.remove:
            rows.append(c.row(KEPT))
        elif dry_run:
            rows.append(c.row(WOULD_REMOVE))
        elif answer is not None and c.path in answer["removed"]:
            rows.append(c.row(REMOVED))
        else:
            why = answer["kept"].get(c.path, "not removed") if answer else "not removed"
            rows.append(c.row(KEPT, why))
    return rows


def summary(rows: Sequence[PruneRow], *, dry_run: bool) -> str:
    """One line: what was (or would be) freed, and how much stays."""
    freed = [r for r in rows if r.action in (REMOVED, WOULD_REMOVE)]
    kept = [r for r in rows if r.action == KEPT]
    verb = "would free" if dry_run else "freed"
    return (
        f"prune {verb} {human_bytes(sum(r.bytes for r in freed))} in {len(freed)} item(s);"
        f" kept {len(kept)} item(s) ({human_bytes(sum(r.bytes for r in kept))})"
        + ("; dry run: run with dry_run=false to remove" if dry_run and freed else "")
    )
