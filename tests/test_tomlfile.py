from pathlib import Path

import pydantic
import pytest

from sparkdeploy.errors import RecipeError
from sparkdeploy.spec.toml_validation import validate_document
from sparkdeploy.spec.tomlfile import MAX_NESTING, format_key, load_toml

FIXTURES = Path(__file__).parent / "fixtures" / "bad"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "file.toml"
    path.write_text(text)
    return path


def test_line_index_covers_tables_arrays_and_inline_keys(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "top = 1\n"  # 1
        "args = [\n"  # 2
        '    "--a", """\n'  # 3
        '\'{"x": 1}\'""",\n'  # 4
        '    "--b",\n'  # 5
        "]\n"  # 6
        "[env]\n"  # 7
        'A = "1"\n'  # 8
        '"quoted.key" = "2"\n'  # 9
        "[[items]]\n"  # 10
        'name = "first"\n'  # 11
        "[[items]]\n"  # 12
        "inline = { deep = 3 }\n"  # 13
        "[[items.sub]]\n"  # 14
        "dotted.key = 4\n",  # 15
    )
    document = load_toml(path, RecipeError)
    assert document.lines[("top",)] == 1
    assert [document.lines[("args", i)] for i in range(3)] == [3, 3, 5]
    assert document.lines[("env", "A")] == 8
    assert document.lines[("env", "quoted.key")] == 9
    assert document.lines[("items", 0, "name")] == 11
    assert document.lines[("items", 1)] == 12
    assert document.lines[("items", 1, "inline", "deep")] == 13
    assert document.lines[("items", 1, "sub", 0, "dotted", "key")] == 15
    assert document.where(("items", 1, "missing")) == f"{path}:12"
    assert document.where(("absent",)) == str(path)


def test_unclosed_basic_string_names_the_line_it_opened_on() -> None:
    path = FIXTURES / "glm53-seed-verbatim.toml"
    with pytest.raises(RecipeError) as caught:
        load_toml(path, RecipeError)
    message = str(caught.value)
    assert message.startswith(f"{path}:94:8: the string opened on line 94 is never closed")
    assert 'add the closing "' in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a = b\n", "file.toml:1:5: not a valid value: quote strings"),
        ("a = 1 2\n", "file.toml:1:7: unexpected text after the value"),
        ("[x]\n[x]\n", "file.toml:2:1: table [x] is declared twice (first on line 1): declare it"),
        ("a.b = 1\n[a]\n", "file.toml:2:3: Cannot declare ('a',) twice: a table may be declared"),
        ("a = { b = 1, }\n", "file.toml:1:14: expected a key: a key is bare"),
        ("a = { b = 1, }\n", "an inline table takes no comma after its last value (`{ a = 1 }`)"),
        ("a = { b = 1 c = 2 }\n", "file.toml:1:13: expected `,` or `}` in the inline table"),
        ('a = "C:\\q"\n', 'file.toml:1:10: a backslash in a "string" starts an escape'),
        ('a = "C:\\q"\n', "write \\\\ for a backslash itself, or use a 'literal string'"),
        (
            "a = { b = 1\nc = 2\n",
            "file.toml:1:5: the inline table opened on line 1 is never closed",
        ),
        ("a = [1, 2\n", "file.toml:1:5: the array opened on line 1 is never closed: add `]`"),
        ("a = [1 2]\n", "file.toml:1:8: expected `,` or `]` after element 1 of the array opened"),
        ("x = 1\nx = 2\n", "file.toml:2:1: key 'x' is set twice (first on line 1)"),
    ],
)
def test_syntax_errors_in_words(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(RecipeError) as caught:
        load_toml(write(tmp_path, text), RecipeError)
    assert expected in str(caught.value)


def test_deep_nesting_is_refused_before_the_parser_overflows_the_stack(tmp_path: Path) -> None:
    deep = f"x = 1\nrun_options = {'[' * 3000}{']' * 3000}\n"
    with pytest.raises(RecipeError) as caught:
        load_toml(write(tmp_path, deep), RecipeError)
    assert "file.toml:2:15: arrays or inline tables nested 3000 levels deep" in str(caught.value)
    assert f"at most {MAX_NESTING} are read" in str(caught.value)
    brackets_in_strings_and_comments = "a = \"[[[[{{\"  # ]]]][[[[\nb = '''{{{'''\nc = [[1]]\n"
    at_the_limit = f"x = {'[' * MAX_NESTING}{']' * MAX_NESTING}\n"
    for text in (brackets_in_strings_and_comments, at_the_limit):
        load_toml(write(tmp_path, text), RecipeError)


def test_unreadable_and_non_utf8_files(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"absent\.toml: cannot read"):
        load_toml(tmp_path / "absent.toml", RecipeError)
    directory = tmp_path / "dir.toml"
    directory.mkdir()
    with pytest.raises(RecipeError, match=r"dir\.toml: is a directory, not a TOML file: name the"):
        load_toml(directory, RecipeError)
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'a = "caf\xe9"\n')
    with pytest.raises(RecipeError, match=r"not UTF-8 text \(byte 8\); save it as UTF-8"):
        load_toml(path, RecipeError)


class Inner(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    revision: str | None = None
    repo: str


class Outer(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    count: int
    sources: list[Inner] = []


def test_validation_errors_point_at_the_key_with_a_suggestion(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'count = "3"\n\n[[sources]]\nrepo = "a/b"\n\n[[sources]]\nrepo = "c/d"\nrevison = "x"\n',
    )
    validated = validate_document(load_toml(path, RecipeError), Outer)
    assert validated.broken == {"count", "sources"}
    assert validated.problems == [
        f"{path}:1: count: Input should be a valid integer (got '3': write it without quotes)",
        f"{path}:8: unknown key 'sources[1].revison': did you mean 'revision'?",
    ]


def test_unknown_key_without_a_close_match_lists_the_known_ones(tmp_path: Path) -> None:
    path = write(tmp_path, "count = 1\nzzz = 2\n")
    validated = validate_document(load_toml(path, RecipeError), Outer)
    assert validated.problems == [f"{path}:2: unknown key 'zzz': known keys here: count, sources"]
    assert validated.value.count == 1  # the valid keys still build the model


def test_a_key_of_another_table_is_told_where_it_goes(tmp_path: Path) -> None:
    path = write(tmp_path, 'count = 1\nrevision = "x"\n[[sources]]\nrepo = "a/b"\ncount = 2\n')
    assert validate_document(load_toml(path, RecipeError), Outer).problems == [
        f"{path}:2: unknown key 'revision': 'revision' belongs in [[sources]]: move it there",
        f"{path}:5: unknown key 'sources[0].count': 'count' belongs in the top level (above the "
        "first [table]): move it there",
    ]


def test_bom_is_dropped_and_crlf_lines_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "file.toml"
    path.write_bytes(b"\xef\xbb\xbfcount = 1\r\n\r\nzzz = 2\r\n")
    assert validate_document(load_toml(path, RecipeError), Outer).problems == [
        f"{path}:3: unknown key 'zzz': known keys here: count, sources"
    ]


def test_format_key() -> None:
    assert format_key(("composed_model", "sources", 0, "repo")) == "composed_model.sources[0].repo"
