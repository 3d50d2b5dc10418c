"""TOML loading whose errors point at file:line and say in words what is wrong.

tomllib gives no positions for keys, so a small scanner indexes the line of every key path
(tables, array-of-tables elements, array elements) after a successful parse. The same scanner,
run on a file tomllib rejected, finds where an unclosed string/array/table opened and which key
was set twice: tomllib only reports those at the end of the document or at the next character.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Generic, TypeVar

import pydantic

from sparkdeploy.errors import SparkDeployError
from sparkdeploy.secrecy import MASK, is_secret_name

KeyPath = tuple[str | int, ...]
ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)

_TABLE_HEADER_LINE = re.compile(r"\[\[?[A-Za-z0-9_.\"' -]+\]\]?[ \t]*(#.*)?$", re.M)
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_TOMLLIB_POSITION = re.compile(
    r"^(?P<what>.*) \((?:at line (?P<line>\d+), column (?P<col>\d+)|at end of document)\)$", re.S
)


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
    except OSError as exc:
        raise error_class(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        raise error_class(
            f"{path}:{line}: not UTF-8 text (byte {exc.start}); save it as UTF-8{_STOPPED}"
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error_class(_syntax_message(path, text, exc)) from None
    scanner = _Scanner(text)
    # tomllib accepted the text; a scanner gap only costs line numbers.
    with contextlib.suppress(_ScanProblem, IndexError, ValueError):
        scanner.scan()
    return TomlDocument(path=path, text=text, data=data, lines=scanner.lines)


def _unwrap(annotation: Any) -> list[Any]:
    """The model classes (or mappings/sequences) a field annotation may hold."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [inner for arg in typing.get_args(annotation) for inner in _unwrap(arg)]
    return [annotation]


def _known_keys(model: type[pydantic.BaseModel], parent: KeyPath) -> list[str]:
    """Field names allowed at `parent` inside `model` (aliases as written in the file)."""
    candidates: list[Any] = [model]
    for part in parent:
        next_candidates: list[Any] = []
        for candidate in candidates:
            origin = typing.get_origin(candidate)
            if isinstance(candidate, type) and issubclass(candidate, pydantic.BaseModel):
                if isinstance(part, str):
                    for name, info in candidate.model_fields.items():
                        if part in (name, info.alias):
                            next_candidates += _unwrap(info.annotation)
            elif origin in (list, tuple) and isinstance(part, int):
                next_candidates += _unwrap(typing.get_args(candidate)[0])
            elif origin is dict and isinstance(part, str):
                next_candidates += _unwrap(typing.get_args(candidate)[1])
        candidates = next_candidates
    keys: list[str] = []
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, pydantic.BaseModel):
            keys += [info.alias or name for name, info in candidate.model_fields.items()]
    return keys


def _tables_with_key(model: type[pydantic.BaseModel], key: str, parent: KeyPath = ()) -> list[str]:
    """The tables of `model` (as TOML headers) where `key` is a known key."""
    found: list[str] = []
    for name, info in model.model_fields.items():
        path = (*parent, info.alias or name)
        for candidate in _unwrap(info.annotation):
            origin = typing.get_origin(candidate)
            if origin in (list, tuple):
                inner, header = typing.get_args(candidate)[0], f"[[{format_key(path)}]]"
            elif origin is dict:
                inner, header = typing.get_args(candidate)[1], f"[{format_key(path)}.<name>]"
            else:
                inner, header = candidate, f"[{format_key(path)}]"
            for table in _unwrap(inner):
                if isinstance(table, type) and issubclass(table, pydantic.BaseModel):
                    if key in _known_keys(table, ()):
                        found.append(header)
                    found += _tables_with_key(table, key, path)
    return found


def _close_match(key: str, known: Sequence[str]) -> str | None:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_key_message(
    where: str, key_path: KeyPath, known: Sequence[str], elsewhere: Sequence[str] = ()
) -> str:
    """A typo gets its close match; a key of another table (`elsewhere`) is told where it goes."""
    key = str(key_path[-1])
    close = _close_match(key, known)
    if close:
        hint = f"did you mean '{close}'?"
    elif elsewhere:
        hint = f"'{key}' belongs in {' or '.join(elsewhere)}: move it there"
    else:
        hint = f"known keys here: {', '.join(known)}"
    return f"{where}: unknown key '{format_key(key_path)}': {hint}"


def _describe(error: Any, secret: bool = False) -> str:
    """Pydantic's error in words; `secret`: the value is a secret, never echoed."""
    kind = error["type"]
    value = error.get("input")
    if secret or any(
        isinstance(part, str) and is_secret_name(part) for part in error.get("loc", ())
    ):
        value = MASK  # a value under a secret's name is never echoed, even a wrong one
    if kind == "missing":
        return "required key is missing: add it"
    if kind in ("string_type", "str_type") and isinstance(value, (list, dict)):
        return (
            f"must be a string, not a {'list' if isinstance(value, list) else 'table'}: "
            f"write one quoted value (got {value!r})"
        )
    if kind in ("string_type", "str_type"):
        return f"must be a string: quote it (got {value!r})"
    if kind == "too_short":
        return f"{error['msg']}: add at least one"
    if kind == "literal_error":
        return f"{error['msg']} (got {value!r})"
    message = str(error["msg"]).removeprefix("Value error, ")
    if kind in ("int_type", "float_type", "bool_type") and isinstance(value, str):
        return f"{message} (got {value!r}: write it without quotes)"
    if isinstance(value, (str, int, float, bool)) and kind != "value_error":
        return f"{message} (got {value!r})"
    return message


@dataclass(frozen=True)
class Validated(Generic[ModelT]):
    """A file's model built from its valid keys, and the problems of the others."""

    value: ModelT  # a field in `broken` has its default, or is unset if it has none
    problems: list[str]  # one `file:line: key: words` line each
    broken: frozenset[str]  # top-level fields with a problem: checks reading them are skipped


def _where_elsewhere(model: type[pydantic.BaseModel], key_path: KeyPath) -> list[str]:
    """Headers of the other tables that know the key; `the top level` for a top-level key."""
    key = str(key_path[-1])
    tables = [t for t in _tables_with_key(model, key) if t.strip("[]") != format_key(key_path)]
    if len(key_path) > 1 and key in _known_keys(model, ()):
        tables.insert(0, "the top level (above the first [table])")
    return tables


def _without_retired(
    document: TomlDocument, retired: Mapping[KeyPath, str]
) -> tuple[dict[str, Any], list[str]]:
    """The data without the retired keys the file still sets, and one problem for each."""
    data = copy.deepcopy(document.data)
    problems = []
    for key_path, instead in retired.items():
        *tables, key = key_path
        table: Any = data
        for part in tables:
            table = table.get(part) if isinstance(table, dict) else None
        if isinstance(table, dict) and key in table:
            del table[key]
            where = document.where(key_path)
            problems.append(f"{where}: {format_key(key_path)} is not read: {instead}")
    return data, problems


def validate_document(
    document: TomlDocument,
    model: type[ModelT],
    retired: Mapping[KeyPath, str] | None = None,
    *,
    secret_at: Callable[[KeyPath], bool] = lambda key_path: False,
) -> Validated[ModelT]:
    """Validate the parsed data; every problem becomes one `file:line: key: words` line.

    The value is built even when some keys are wrong, from the fields that are right, so the
    caller's own checks can still run on those and report their problems in the same pass.
    `retired`: keys the format no longer reads, each with what to do instead. A file that still
    sets one gets that as its problem (not "unknown key", whose did-you-mean would point at
    another key), and the rest of the file is checked as if the key were not there.
    `secret_at`: whether a key holds a secret value (beyond a secret's name, which is always one),
    whose wrong value a problem never quotes.
    """
    data, problems = _without_retired(document, retired or {})
    try:
        value = model.model_validate(data)
    except pydantic.ValidationError as exc:
        errors = exc.errors()
    else:
        return Validated(value, document.in_file_order(problems), frozenset())
    by_key = {info.alias or name: name for name, info in model.model_fields.items()}
    broken: set[str] = set()
    for error in errors:
        key_path: KeyPath = tuple(error["loc"])
        where = document.where(key_path)
        if key_path and key_path[0] in by_key:
            broken.add(by_key[str(key_path[0])])
        elif error["type"] == "extra_forbidden":
            # A misspelt top-level key: the field it meant holds its default, not the file's value.
            meant = _close_match(str(key_path[0]), list(by_key))
            if meant is not None:
                broken.add(by_key[meant])
        if error["type"] == "extra_forbidden":
            problems.append(
                unknown_key_message(
                    where,
                    key_path,
                    _known_keys(model, key_path[:-1]),
                    _where_elsewhere(model, key_path),
                )
            )
        elif key_path:
            described = _describe(error, secret_at(key_path))
            problems.append(f"{where}: {format_key(key_path)}: {described}")
        else:
            problems.append(f"{where}: {_describe(error)}")
    # Each right field again on its own (it passed above, so this cannot fail); the model's
    # construction skips validation, which the broken fields would not pass.
    fields: dict[str, Any] = {}
    for key, name in by_key.items():
        if name in broken or key not in data:
            continue
        field: Any = Annotated[model.model_fields[name].annotation, model.model_fields[name]]
        fields[name] = pydantic.TypeAdapter(field).validate_python(data[key])
    value = model.model_construct(**fields)
    return Validated(value, document.in_file_order(problems), frozenset(broken))
