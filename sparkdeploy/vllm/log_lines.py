"""vLLM's log lines read: the prefix taken off, the figures a marker's line carries, the failure a
fatal line means (with the root cause vLLM printed above it) and the markers a node has shown.

`classify_log(lines, node=..., node_of_ip=...)` is the failure in one container's log, for the
readiness gate and for whoever watches a deployment after it was ready; NodeLog is one node's log
as the readiness gate reads it, a line at a time. Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import re
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sparkdeploy.errors import BootFailed
from sparkdeploy.vllm.markers import (
    DEFAULT_FAILURE_MARKERS,
    FAILURE_HINTS,
    ROOT_CAUSE_ABOVE,
    SHUTDOWN_TRIGGERED,
    MarkerLike,
)

LINES_KEPT_PER_NODE = 400
LINES_BEFORE = 8
LINES_AFTER = 6
_MAX_QUOTED_LINE = 400

# "(EngineCore_DP0 pid=12) ERROR 09-18 12:00:00 [core.py:708] " and uvicorn's "INFO:     ".
_VLLM_PREFIX = re.compile(
    r"^(?:\([\w.-]+ pid=\d+\)\s+)?"
    r"(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s+"
    r"|(?:INFO|WARNING|ERROR):\s+)?"
)
_EXCEPTION_LINE = re.compile(
    r"(?:^|[\s\]>|])(?P<text>(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt): .*)$"
)
_SHUTDOWN = re.compile(SHUTDOWN_TRIGGERED)

CompiledMarkers = list[tuple[str, re.Pattern[str]]]


@dataclass(frozen=True)
class LogLine:
    node: str
    line: str
    t: float  # time.monotonic() when the line was read


@dataclass(frozen=True)
class Failure:
    node: str  # the node that failed
    kind: str
    cause: str
    excerpt: list[str]
    log_node: str | None = None  # whose log the excerpt is, when not the failed node's
    hint: str | None = None  # when FAILURE_HINTS has none for this kind

    def followed_by(self, lines: Sequence[str]) -> Failure:
        """The same failure with the log lines that came after the fatal one quoted too."""
        return dataclasses.replace(self, excerpt=[*self.excerpt, *lines]) if lines else self

    def to_error(self, seconds: float) -> BootFailed:
        quoted = "\n".join(f"  | {line}" for line in self.excerpt)
        hint = self.hint or FAILURE_HINTS.get(self.kind, FAILURE_HINTS["container_exited"])
        message = (
            f"boot failed on {self.node} after {seconds:.1f} s ({self.kind}): {self.cause}\n"
            f"log of {self.log_node or self.node}:\n{quoted}\nfix: {hint}"
        )
        return BootFailed(
            message, node=self.node, kind=self.kind, cause=self.cause, excerpt=self.excerpt
        )


def strip_log_prefix(line: str) -> str:
    return _VLLM_PREFIX.sub("", line, count=1).strip()


def quote_line(line: str) -> str:
    """`line` as an excerpt quotes it: cut at _MAX_QUOTED_LINE characters."""
    return line if len(line) <= _MAX_QUOTED_LINE else line[:_MAX_QUOTED_LINE] + " ..."


def parse_figures(match: re.Match[str]) -> dict[str, float]:
    return {
        name: float(value.replace(",", ""))
        for name, value in match.groupdict().items()
        if value is not None
    }


def find_root_cause(lines: Sequence[str]) -> int | None:
    """Index of the last exception line ("FooError: ...") in `lines`, or None."""
    for index in range(len(lines) - 1, -1, -1):
        if _EXCEPTION_LINE.search(lines[index]):
            return index
    return None


def exception_text(line: str) -> str:
    match = _EXCEPTION_LINE.search(line)
    return match.group("text").strip() if match else strip_log_prefix(line)


def compile_markers(markers: Sequence[MarkerLike]) -> CompiledMarkers:
    return [(marker.name, re.compile(marker.pattern)) for marker in markers]


def fatal_marker(line: str, failure_markers: CompiledMarkers) -> tuple[str, re.Match[str]] | None:
    """The first failure marker `line` matches, and its match; None for a harmless line."""
    for name, pattern in failure_markers:
        match = pattern.search(line)
        if match is not None:
            return name, match
    return None


def _peer_node(ip: str, node_of_ip: Mapping[str, str]) -> str:
    node = node_of_ip.get(ip)
    return f"{node} ({ip})" if node else f"at {ip} (no node of this deployment has that address)"


def failure_of_line(
    node: str,
    name: str,
    match: re.Match[str],
    line: str,
    earlier: Sequence[str],
    node_of_ip: Mapping[str, str] | None = None,
) -> Failure:
    """The Failure a fatal `line` of `node`'s log means (`earlier`: the lines before it)."""
    before = [quote_line(text) for text in earlier[-LINES_BEFORE:]]
    cause = f"{name}: {strip_log_prefix(line)}"
    if name in ROOT_CAUSE_ABOVE:
        root = find_root_cause(earlier)
        if root is not None:
            cause = (
                f"{name}: the engine core died of {exception_text(earlier[root])} "
                f"(quoted above the final error)"
            )
            before = [quote_line(text) for text in earlier[max(root - LINES_BEFORE, 0) : root + 1]]
            if root + 1 < len(earlier):
                before.append("...")
    peer = match.groupdict().get("peer_ip")
    if name == "worker_died" and peer is not None:
        cause = (
            f"worker_died: the worker {_peer_node(peer, node_of_ip or {})} closed its "
            f"connection to {node} (its engine process died); {node}'s engine then dies and "
            f"exits with status 0: {exception_text(line)}"
        )
        dead = (node_of_ip or {}).get(peer)
        if dead is not None:
            return Failure(dead, name, cause, [*before, quote_line(line)], log_node=node)
    return Failure(node, name, cause, [*before, quote_line(line)])


def classify_log(
    lines: Sequence[str],
    *,
    node: str,
    node_of_ip: Mapping[str, str] | None = None,
    failure_markers: Sequence[MarkerLike] = DEFAULT_FAILURE_MARKERS,
) -> Failure | None:
    """The named failure in one container's log lines (the first fatal line), or None.

    For the gate and for whoever watches a running deployment (the smoke watchdog): `node` is
    the node whose log this is; `node_of_ip` maps fabric addresses to node names, so that the
    head's "Connection closed by peer [ip]" names the worker that died. Lines after vLLM's
    "[shutdown] API server: shutdown triggered" (a deliberate stop) are not read.
    """
    compiled = compile_markers(failure_markers)
    for index, line in enumerate(lines):
        if _SHUTDOWN.search(line):
            return None
        fatal = fatal_marker(line, compiled)
        if fatal is not None:
            name, match = fatal
            earlier = lines[max(index - LINES_KEPT_PER_NODE, 0) : index]
            failure = failure_of_line(node, name, match, line, earlier, node_of_ip)
            trailing = [quote_line(text) for text in lines[index + 1 : index + 1 + LINES_AFTER]]
            return failure.followed_by(trailing)
    return None


@dataclass
class NodeLog:
    """One node's log as the gate reads it: its last lines, the markers it must print (awaited
    in this order), those it may print (recorded, never awaited), and those seen."""

    markers: CompiledMarkers  # required
    recorded: CompiledMarkers = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=LINES_KEPT_PER_NODE))

    @classmethod
    def watching(cls, required: Sequence[MarkerLike], recorded: Sequence[MarkerLike]) -> NodeLog:
        """A node's markers; a recorded marker named like a required one is dropped."""
        names = {marker.name for marker in required}
        extra = [marker for marker in recorded if marker.name not in names]
        return cls(compile_markers(required), compile_markers(extra))

    def awaited(self) -> tuple[str, str] | None:
        """(name, pattern) of the first required marker not seen yet."""
        for name, pattern in self.markers:
            if name not in self.seen:
                return name, pattern.pattern
        return None

    def newly_seen(self, line: str) -> list[tuple[str, dict[str, float]]]:
        """The markers `line` shows for the first time (one line may show several), each with
        the figures it carries; they count as seen from now on."""
        found = []
        for name, pattern in [*self.markers, *self.recorded]:
            if name in self.seen:
                continue
            match = pattern.search(line)
            if match is None:
                continue
            self.seen.add(name)
            found.append((name, parse_figures(match)))
        return found
