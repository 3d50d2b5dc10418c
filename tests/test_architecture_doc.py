"""docs/architecture.md says what the code is: every path and module it names exists, every
module of flows/, tasks/ and sparkdeploy/ is named in its tree, its cli.py line names every
command, and the modules it says need Prefect are exactly those that cannot be imported
without it.

The tree is the doc's first fenced block. A line that starts with names (`name.py` or `name/`,
comma-separated) is an entry: a name ending in `/` is a directory, whose entries are the lines
indented under it; a `.py` entry's more indented lines are its siblings that serve it (the
same directory). A path written in an entry's description (`node/probe.py`,
`prefetch/preview.py`) is looked for from the entry's directory up to the root. Outside the
tree, paths under the project's top directories and dotted names of our modules
(`sparkdeploy.remote.ssh.connect`) must name what exists."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parent.parent
DOC = ROOT / "docs" / "architecture.md"
# The directories whose every module the tree must name.
CODE_DIRS = ("flows", "tasks", "sparkdeploy")
# The section that names what needs Prefect.
NEEDS_PREFECT = "## What needs Prefect"

ENTRY = re.compile(r"(?P<indent> *)(?P<names>[\w.-]+(?:/|\.py)(?:, [\w.-]+(?:/|\.py))*)(?= |$)")
# A path in a description: a file's or a directory's (ending in /).
MENTIONED = re.compile(r"(?<![\w/.~-])((?:[\w.-]+/)*(?:[\w-]+\.py\b|[\w.-]+/(?![\w.])))")
# Outside the tree: paths under the project's top directories, globs allowed.
PROSE_PATH = re.compile(
    r"(?<![\w/.~-])((?:sparkdeploy|flows|tasks|lab|tests|bench|scripts|docs)/[\w./*-]*[\w*])"
)
DOTTED = re.compile(r"`(sparkdeploy(?:\.\w+)+)`")


def tree_lines() -> list[str]:
    text = DOC.read_text()
    found = re.search(r"^```\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    assert found, "docs/architecture.md has no tree"
    return found.group(1).splitlines()


def resolved(mention: str, directory: Path) -> Path | None:
    """`mention` from `directory` or the nearest of its ancestors that has it."""
    for base in (directory, *directory.parents):
        if (ROOT / base / mention).exists():
            return base / mention
        if base == Path("."):
            break
    return None


@dataclass
class Tree:
    named: set[Path]  # each a path relative to ROOT
    unknown: list[str]  # names the tree gives that exist nowhere


def read_tree() -> Tree:
    tree = Tree(named=set(), unknown=[])
    # (indent of the entry, the directory its more indented lines are in)
    open_entries: list[tuple[int, Path]] = []
    directory = Path(".")
    for line in tree_lines():
        entry = ENTRY.match(line)
        if entry:
            indent = len(entry.group("indent"))
            while open_entries and open_entries[-1][0] >= indent:
                open_entries.pop()
            parent = open_entries[-1][1] if open_entries else Path(".")
            names = entry.group("names").split(", ")
            for name in names:
                path = parent / name
                if (ROOT / path).exists():
                    tree.named.add(path)
                else:
                    tree.unknown.append(f"{path} (the entry {line.strip()!r})")
            directory = parent / names[0] if names[0].endswith("/") else parent
            open_entries.append((indent, directory))
            description = line[entry.end() :]
        else:
            description = line
        for mention in MENTIONED.findall(description):
            found = resolved(mention, directory)
            if found is None:
                tree.unknown.append(f"{mention} (in {directory}/: {line.strip()!r})")
            else:
                tree.named.add(found)
    return tree


def code_modules() -> list[Path]:
    return sorted(
        path.relative_to(ROOT)
        for top in CODE_DIRS
        for path in (ROOT / top).rglob("*.py")
        if path.name != "__init__.py"
    )


def step_names() -> set[str]:
    """The steps of sparkdeploy/steps/: a module's or a package's name."""
    steps = ROOT / "sparkdeploy" / "steps"
    return {path.stem for path in steps.glob("*.py")} | {
        path.name for path in steps.iterdir() if (path / "__init__.py").exists()
    }


def test_every_name_in_the_tree_exists() -> None:
    assert read_tree().unknown == []


def test_every_module_is_named_in_the_tree() -> None:
    """flows/, tasks/ and sparkdeploy/: each module named, but for the task modules named as
    their step ("one Prefect task module per step, named as its task")."""
    named = read_tree().named
    steps = step_names()
    unnamed = [
        str(module)
        for module in code_modules()
        if module not in named and not (module.parts[0] == "tasks" and module.stem in steps)
    ]
    assert unnamed == [], "name these in docs/architecture.md's tree"


def test_every_path_named_outside_the_tree_exists() -> None:
    text = DOC.read_text()
    tree = re.search(r"^```\n.*?^```", text, flags=re.MULTILINE | re.DOTALL)
    assert tree
    prose = text[: tree.start()] + text[tree.end() :]
    missing = [
        path
        for path in sorted(set(PROSE_PATH.findall(prose)))
        if not list(ROOT.glob(path.rstrip("/")))
    ]
    assert missing == []


def test_every_module_named_by_its_dotted_name_exists() -> None:
    """`sparkdeploy.x.y` or `sparkdeploy.x.y.name`: a module, or a name a module defines.
    Dotted names whose first part is not a package of ours (`sparkdeploy.deployment.unhealthy`,
    an event) are not modules."""
    packages = {path.name for path in (ROOT / "sparkdeploy").iterdir()} | {
        path.stem for path in (ROOT / "sparkdeploy").glob("*.py")
    }
    missing = []
    for dotted in sorted(set(DOTTED.findall(DOC.read_text()))):
        parts = dotted.split(".")
        if parts[1] not in packages:
            continue
        try:
            importlib.import_module(dotted)
        except ModuleNotFoundError:
            module, _, name = dotted.rpartition(".")
            if not hasattr(importlib.import_module(module), name):
                missing.append(dotted)
    assert missing == []


def entry_text(name: str) -> str:
    """The tree's entry `name` with its description's lines."""
    lines = tree_lines()
    [start] = [i for i, line in enumerate(lines) if line.lstrip().startswith(f"{name} ")]
    indent = len(lines[start]) - len(lines[start].lstrip())
    text = [lines[start]]
    for line in lines[start + 1 :]:
        entry = ENTRY.match(line)
        if entry and len(entry.group("indent")) <= indent:
            break
        text.append(line)
    return "\n".join(text)


def test_the_cli_entry_names_every_command() -> None:
    import typer

    from sparkdeploy.cli import app

    described = entry_text("cli.py")
    commands = typer.main.get_group(app).commands
    assert [name for name in commands if not re.search(rf"\b{name}\b", described)] == []


# Run in a process of its own: every module of sparkdeploy/ imported with Prefect hidden; the
# modules that fail, one per line. A module that fails takes with it what it loaded, so a later
# module is imported whole again (a submodule left loaded by a failed package would pass).
IMPORTED_WITHOUT_PREFECT = """
import importlib, sys
from pathlib import Path

class HidePrefect:
    def find_spec(self, name, path=None, target=None):
        if name == "prefect" or name.startswith("prefect."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, HidePrefect())
for path in sorted(Path("sparkdeploy").rglob("*.py")):
    module = ".".join(path.with_suffix("").parts).removesuffix(".__init__")
    loaded = set(sys.modules)
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != "prefect" and not error.name.startswith("prefect."):
            raise
        print(path)
        for name in set(sys.modules) - loaded:
            del sys.modules[name]
"""


def needing_prefect() -> set[Path]:
    result = subprocess.run(
        [sys.executable, "-c", IMPORTED_WITHOUT_PREFECT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return {Path(line) for line in result.stdout.splitlines()}


def said_to_need_prefect() -> set[Path]:
    """The modules the doc's "What needs Prefect" section names: a directory stands for its
    modules."""
    text = DOC.read_text()
    start = text.find(f"\n{NEEDS_PREFECT}\n")
    assert start >= 0, f"docs/architecture.md has no {NEEDS_PREFECT!r} section"
    section = text[start + len(NEEDS_PREFECT) + 2 :].split("\n## ", 1)[0]
    modules = set()
    for name in re.findall(r"`(sparkdeploy/[\w/.]+)`", section):
        path = ROOT / name
        assert path.exists(), f"{name}, in {NEEDS_PREFECT}, does not exist"
        found = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        modules |= {module.relative_to(ROOT) for module in found}
    return modules


def test_what_needs_prefect_is_what_the_doc_says() -> None:
    needed = needing_prefect()
    said = said_to_need_prefect()
    assert sorted(map(str, needed - said)) == [], "need Prefect, not named in the doc"
    assert sorted(map(str, said - needed)) == [], "named in the doc, import without Prefect"
