"""sparkdeploy.steps.prefetch.selection: by default the prefetch takes what an engine reads (the
top level's configs, tokenizer files, templates, code and weights), and a recipe's [prefetch]
include/exclude patterns widen or narrow it; a repo fetched under one selection is not complete
under another, and only what the new one adds is fetched."""

from __future__ import annotations

from pathlib import Path

from prefetch_hub import TINY, fetch

from lab.hub.server import HubServer
from sparkdeploy.steps.prefetch.hub import HubFile
from sparkdeploy.steps.prefetch.selection import FileSelection

pytest_plugins = ["prefetch_fixtures"]


def listed(*paths: str) -> list[HubFile]:
    return [HubFile(path, 1, "0" * 40, None) for path in paths]


def test_the_default_takes_the_top_level_files_an_engine_reads() -> None:
    read_by_an_engine = [
        "config.json",
        "tokenizer.json",
        "tokenizer.model",
        "chat_template.jinja",
        "merges.txt",
        "modeling_custom.py",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    files = listed(
        *read_by_an_engine,
        "pytorch_model.bin",
        "README.md",
        ".gitattributes",
        "original/consolidated.safetensors",
        "metal/model.bin",
    )
    assert [f.path for f in FileSelection().select(files)] == read_by_an_engine


def test_older_weight_formats_count_only_without_safetensors() -> None:
    taken = [f.path for f in FileSelection().select(listed("config.json", "pytorch_model.bin"))]
    assert taken == ["config.json", "pytorch_model.bin"]


def test_include_and_exclude_patterns_apply_to_repo_paths() -> None:
    files = listed("config.json", "model.safetensors", "original/params.json", "extra.py")
    selection = FileSelection(include=("original/*",), exclude=("*.py",))
    assert [f.path for f in selection.select(files)] == [
        "config.json",
        "model.safetensors",
        "original/params.json",
    ]


def test_a_grown_repo_costs_nothing_more_until_a_recipe_includes_the_new_paths(
    hub: HubServer, nas: Path, repos_dir: Path
) -> None:
    extra = repos_dir / TINY / "original" / "consolidated.safetensors"
    extra.parent.mkdir()
    extra.write_bytes(b"\1" * 8192)
    (repos_dir / TINY / "README.md").write_text("# tiny\n")
    default = fetch(hub, nas)
    paths = {f.path for f in default.files}
    assert "original/consolidated.safetensors" not in paths
    assert "README.md" not in paths
    assert "config.json" in paths

    hub.reset_stats()
    widened = fetch(hub, nas, selection=FileSelection(include=("original/*",)))
    assert widened.sha == default.sha
    assert {f.path for f in widened.files} == paths | {"original/consolidated.safetensors"}
    assert widened.fetched_bytes == 8192  # only what the wider selection adds
    hub.reset_stats()
    again = fetch(hub, nas, selection=FileSelection(include=("original/*",)))
    assert again.fetched_bytes == 0
    assert hub.request_count == 0
