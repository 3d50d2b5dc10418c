"""TOML loading whose errors point at file:line and say in words what is wrong.

tomllib gives no positions for keys, so a small scanner indexes the line of every key path
(tables, array-of-tables elements, array elements) after a successful parse. The same scanner,
run on a file tomllib rejected, finds where an unclosed string/array/table opened and which key
was set twice: tomllib only reports those at the end of the document or at the next character.
The data is checked against a model by sparkdeploy.spec.toml_validation.
"""

from __future__ import annotations

import contextlib
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkdeploy.errors import SparkDeployError

KeyPath = tuple[str | int, ...]

_TABLE_HEADER_LINE = re.compile(r"\[\[?[A-Za-z0-9_.\"' -]+\]\]?[ \t]*(#.*)?$", re.M)
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_TOMLLIB_POSITION = re.compile(
    r"^(?P<what>.*) \((?:at line (?P<line>\d+), column (?P<col>\d+)|at end of document)\)$", re.S
)
# No key takes more than a few levels; tomllib recurses once per level and would overflow
# Python's stack (a RecursionError) on a few hundred, so deeper text is refused before it parses.
MAX_NESTING = 100
_NESTING_CHARS = re.compile(r"[\"'#\[\]{}]")


def format_key(path: Sequence[str | int]) -> str:
    """`composed_model.sources[0].repo` for ("composed_model", "sources", 0, "repo")."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text


@dataclass
class TomlDocument:
    """A parsed TOML file and the line on which each key path was written."""

    path: Path
    text: str
    data: dict[str, Any]
    lines: dict[KeyPath, int] = field(default_factory=dict)

    def line_of(self, key_path: Sequence[str | int]) -> int | None:
        """Line of the key, else of its closest enclosing key that was written down."""
        path = tuple(key_path)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None

    def where(self, key_path: Sequence[str | int]) -> str:
        """`file:line` of a key (just `file` for a key absent from the file at top level)."""
        line = self.line_of(key_path)
        return f"{self.path}:{line}" if line is not None else str(self.path)

    def in_file_order(self, problems: Sequence[str]) -> list[str]:
        """Problems sorted by the line they name; those about the whole file come first.

        Every problem starts with `where()`'s text, so its line is read back from there; the
        sort is stable, so one line's problems keep the order they were found in.
        """
        prefix = re.compile(re.escape(str(self.path)) + r":(\d+)")

        def line(problem: str) -> int:
            match = prefix.match(problem)
            return int(match.group(1)) if match else 0

        return sorted(problems, key=line)


class _ScanProblem(Exception):
    def __init__(self, offset: int, message: str) -> None:
        super().__init__(message)
        self.offset = offset
        self.message = message


class _Scanner:
    """Walks TOML text far enough to know where keys, strings and brackets start and end."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
        self.lines: dict[KeyPath, int] = {}
        self.value_lines: dict[KeyPath, int] = {}
        self.table_lines: dict[KeyPath, int] = {}
        self.table_counts: dict[KeyPath, int] = {}
        self.table: KeyPath = ()

    def line_col(self, offset: int) -> tuple[int, int]:
        low, high = 0, len(self.line_starts) - 1
        while low < high:
            mid = (low + high + 1) // 2
            if self.line_starts[mid] <= offset:
                low = mid
            else:
                high = mid - 1
        return low + 1, offset - self.line_starts[low] + 1

    def line(self, offset: int) -> int:
        return self.line_col(offset)[0]

    def peek(self, count: int = 1) -> str:
        return self.text[self.pos : self.pos + count]

    def skip_blank(self, newlines: bool) -> None:
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char in " \t\r" or (newlines and char == "\n"):
                self.pos += 1
            elif char == "#":
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end
            else:
                return

    def scan(self) -> None:
        while True:
            self.skip_blank(newlines=True)
            if self.pos >= len(self.text):
                return
            if self.peek() == "[":
                self.header()
            else:
                start = self.pos
                key = self.key()
                path = self.table + key
                if path in self.value_lines:
                    first = self.value_lines[path]
                    raise _ScanProblem(
                        start,
                        f"key '{format_key(path)}' is set twice (first on line {first}); "
                        "keep one of them",
                    )
                self.value_lines[path] = self.line(start)
                self.lines[path] = self.line(start)
                self.expect_equals()
                self.value(path)
            self.end_of_statement()

    def end_of_statement(self) -> None:
        self.skip_blank(newlines=False)
        if self.pos < len(self.text) and self.peek() != "\n":
            raise _ScanProblem(
                self.pos,
                "unexpected text after the value: one `key = value` per line (a missing quote "
                "or comma?)",
            )

    def header(self) -> None:
        start = self.pos
        array = self.peek(2) == "[["
        self.pos += 2 if array else 1
        parts = self.key()
        self.skip_blank(newlines=False)
        closing = "]]" if array else "]"
        if self.peek(len(closing)) != closing:
            raise _ScanProblem(start, f"table header is not closed: end it with `{closing}`")
        self.pos += len(closing)
        resolved: KeyPath = ()
        for index, part in enumerate(parts):
            resolved += (part,)
            last = index == len(parts) - 1
            if resolved in self.table_counts and not last:
                resolved += (self.table_counts[resolved] - 1,)
        line = self.line(start)
        if not array and resolved in self.table_lines:
            raise _ScanProblem(
                start,
                f"table [{format_key(parts)}] is declared twice (first on line "
                f"{self.table_lines[resolved]}): declare it once, with the keys of both",
            )
        if not array:
            self.table_lines[resolved] = line
        self.lines.setdefault(resolved, line)
        if array:
            element = self.table_counts.get(resolved, 0)
            self.table_counts[resolved] = element + 1
            resolved += (element,)
            self.lines[resolved] = line
        self.table = resolved

    def key(self) -> KeyPath:
        parts: list[str] = []
        while True:
            self.skip_blank(newlines=False)
            char = self.peek()
            if char in ('"', "'"):
                parts.append(self.string())
            else:
                match = _BARE_KEY.match(self.text, self.pos)
                if not match:
                    raise _ScanProblem(self.pos, "expected a key")
                parts.append(match.group())
                self.pos = match.end()
            self.skip_blank(newlines=False)
            if self.peek() != ".":
                return tuple(parts)
            self.pos += 1

    def expect_equals(self) -> None:
        self.skip_blank(newlines=False)
        if self.peek() != "=":
            raise _ScanProblem(self.pos, "expected `=` after the key")
        self.pos += 1
        self.skip_blank(newlines=False)

    def string(self) -> str:
        start = self.pos
        quote = self.text[self.pos]
        multiline = self.peek(3) == quote * 3
        self.pos += 3 if multiline else 1
        chars: list[str] = []
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if multiline and self.peek(3) == quote * 3:
                # Up to two quotes may sit right before the closing three.
                while self.peek(4) == quote * 4:
                    chars.append(quote)
                    self.pos += 1
                self.pos += 3
                return "".join(chars)
            if not multiline and char == quote:
                self.pos += 1
                return "".join(chars)
            if not multiline and char == "\n":
                raise _ScanProblem(
                    start,
                    f"the string opened on line {{line}} is never closed: add the closing {quote} "
                    f"before the end of the line (a string spanning lines needs {quote * 3})",
                )
            if char == "\\" and quote == '"':
                chars.append(self.text[self.pos : self.pos + 2])
                self.pos += 2
                continue
            chars.append(char)
            self.pos += 1
        kind = "multi-line string" if multiline else "string"
        closing = quote * 3 if multiline else quote
        raise _ScanProblem(
            start, f"the {kind} opened on line {{line}} is never closed: add {closing}"
        )

    def deepest_nesting(self) -> tuple[int, int]:
        """How many levels arrays and inline tables nest at most, and the offset of the outermost
        bracket of the value that nests that deep. Iterative, unlike a parser; stops at a string
        that is never closed (the parse reports that)."""
        depth = deepest = opened = deepest_opened = 0
        with contextlib.suppress(_ScanProblem):
            while match := _NESTING_CHARS.search(self.text, self.pos):
                self.pos = match.start()
                char = match.group()
                if char in "\"'":
                    self.string()
                    continue
                if char == "#":
                    self.skip_blank(newlines=False)
                    continue
                if char in "[{":
                    opened = self.pos if depth == 0 else opened
                    depth += 1
                    if depth > deepest:
                        deepest, deepest_opened = depth, opened
                else:
                    depth = max(depth - 1, 0)
                self.pos += 1
        return deepest, deepest_opened

    def value(self, path: KeyPath) -> None:
        char = self.peek()
        if char in ('"', "'"):
            self.string()
        elif char == "[":
            self.array(path)
        elif char == "{":
            self.inline_table(path)
        else:
            match = re.compile(r"[^,\]}\s#]+").match(self.text, self.pos)
            if not match:
                raise _ScanProblem(self.pos, "expected a value")
            self.pos = match.end()

    def array(self, path: KeyPath) -> None:
        start = self.pos
        self.pos += 1
        element = 0
        while True:
            self.skip_blank(newlines=True)
            if self.pos >= len(self.text):
                raise _ScanProblem(
                    start, "the array opened on line {line} is never closed: add `]`"
                )
            if self.peek() == "]":
                self.pos += 1
                return
            if _TABLE_HEADER_LINE.match(self.text, self.pos) and self.line_col(self.pos)[1] == 1:
                raise _ScanProblem(
                    start,
                    "the array opened on line {line} is never closed: add `]` before the "
                    f"table header on line {self.line(self.pos)}",
                )
            self.lines[(*path, element)] = self.line(self.pos)
            self.value((*path, element))
            element += 1
            self.skip_blank(newlines=True)
            if self.peek() == ",":
                self.pos += 1
            elif self.peek() != "]":
                if self.pos >= len(self.text):
                    raise _ScanProblem(
                        start, "the array opened on line {line} is never closed: add `]`"
                    )
                raise _ScanProblem(
                    self.pos,
                    f"expected `,` or `]` after element {element} of the array opened on line "
                    f"{self.line(start)} (a missing comma?)",
                )

    def inline_table(self, path: KeyPath) -> None:
        start = self.pos
        self.pos += 1
        while True:
            self.skip_blank(newlines=False)
            if self.pos >= len(self.text) or self.peek() == "\n":
                raise _ScanProblem(
                    start,
                    "the inline table opened on line {line} is never closed: add `}` on that line",
                )
            if self.peek() == "}":
                self.pos += 1
                return
            key_start = self.pos
            key_path = path + self.key()
            self.lines[key_path] = self.line(key_start)
            self.expect_equals()
            self.value(key_path)
            self.skip_blank(newlines=False)
            if self.peek() == ",":
                self.pos += 1


_TOMLLIB_WORDS = {
    "Invalid value": 'not a valid value: quote strings ("..."); numbers, true/false, '
    "[arrays] and {tables} go without quotes",
    "Expected '=' after a key in a key/value pair": "expected `=` after the key (a key with "
    "spaces or dots in it must be quoted)",
    "Expected newline or end of document after a statement": "unexpected text after the value: "
    "one `key = value` per line (a missing quote or comma?)",
    "Invalid initial character for a key part": "expected a key: a key is bare (letters, digits, "
    "_ and -) or quoted, and an inline table takes no comma after its last value (`{ a = 1 }`)",
    "Unclosed inline table": "expected `,` or `}` in the inline table: separate its values with "
    "commas, all on one line (`{ a = 1, b = 2 }`)",
    "Unescaped '\\' in a string": 'a backslash in a "string" starts an escape (\\n, \\t, \\", '
    "\\\\, \\uXXXX): write \\\\ for a backslash itself, or use a 'literal string' (single quotes)",
}


# A file that does not parse has no keys to check: the problems after it would be guesses.
_STOPPED = " (the rest of the file is checked once this is fixed)"


def _syntax_message(path: Path, text: str, error: tomllib.TOMLDecodeError) -> str:
    scanner = _Scanner(text)
    try:
        scanner.scan()
    except _ScanProblem as problem:
        line, col = scanner.line_col(problem.offset)
        message = problem.message.replace("{line}", str(line))
        return f"{path}:{line}:{col}: {message}{_STOPPED}"
    except (IndexError, ValueError):
        pass  # the scanner is best effort on broken text; tomllib's words follow
    match = _TOMLLIB_POSITION.match(str(error))
    what = match.group("what") if match else str(error)
    words = _TOMLLIB_WORDS.get(what, what)
    if what.startswith("Cannot declare"):
        words = f"{what}: a table may be declared once; merge the two"
    if match and match.group("line"):
        return f"{path}:{match.group('line')}:{match.group('col')}: {words}{_STOPPED}"
    return f"{path}: {words} (at the end of the file){_STOPPED}"


def load_toml(path: Path, error_class: type[SparkDeployError]) -> TomlDocument:
    """Parse a TOML file; syntax errors raise `error_class` naming file:line:col in words."""
    try:
        # utf-8-sig: a byte order mark (some Windows editors write one) is dropped, not an error.
        text = path.read_text(encoding="utf-8-sig")
    except IsADirectoryError:
        raise error_class(
            f"{path}: is a directory, not a TOML file: name the file (a recipe is "
            "recipes/<name>/recipe.toml, an inventory clusters/<name>.toml)"
        ) from None
    except OSError as exc:
        raise error_class(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        raise error_class(
            f"{path}:{line}: not UTF-8 text (byte {exc.start}); save it as UTF-8{_STOPPED}"
        ) from None
    nesting = _Scanner(text)
    deepest, opened = nesting.deepest_nesting()
    if deepest > MAX_NESTING:
        line, col = nesting.line_col(opened)
        raise error_class(
            f"{path}:{line}:{col}: arrays or inline tables nested {deepest} levels deep: no key "
            f"takes more than a few (at most {MAX_NESTING} are read); write the value as its "
            f"key's documentation shows{_STOPPED}"
        )
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error_class(_syntax_message(path, text, exc)) from None
    scanner = _Scanner(text)
    # tomllib accepted the text; a scanner gap only costs line numbers.
    with contextlib.suppress(_ScanProblem, IndexError, ValueError):
        scanner.scan()
    return TomlDocument(path=path, text=text, data=data, lines=scanner.lines)
