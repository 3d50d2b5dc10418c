"""A parsed TOML document checked against a pydantic model, in words a person can act on.

Each problem is one `file:line: key: words` line (the line from sparkdeploy.spec.tomlfile's
TomlDocument): an unknown key gets its did-you-mean, or the table it belongs in; a wrong value
what it must be, never quoting a secret.
"""

from __future__ import annotations

import copy
import difflib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Generic, TypeVar

import pydantic

from sparkdeploy.secrecy import MASK, is_secret_name
from sparkdeploy.spec.tomlfile import KeyPath, TomlDocument, format_key

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)


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
