"""Where a recipe's image comes from: pulled by its name, built from images/<dir> here (the
build context and its digest, which labels the image), or built elsewhere (a docker_image_dir
this checkout lacks: used only as every node holds it)."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sparkdeploy.errors import ImageError
from sparkdeploy.spec.project import find_image_dir, image_dir_fix, image_dir_path

CONTEXT_LABEL = "sparkdeploy.context-sha256"


@dataclass(frozen=True)
class BuildContext:
    tar: bytes
    digest: str  # of paths, modes and contents (not mtimes): equal dirs, equal digest


@dataclass(frozen=True)
class BuiltElsewhere:
    """A recipe whose docker_image_dir is not in this checkout: its image cannot be built here."""

    recipe: str
    docker_image_dir: str
    missing: Path  # where its build context would be: images/<docker_image_dir>


def image_source(
    recipe: str, docker_image_dir: str | None, root: Path | None = None
) -> tuple[Path | None, BuiltElsewhere | None]:
    """The build context of a recipe's image, or that it was built elsewhere; neither for an
    image that is pulled (no docker_image_dir)."""
    if docker_image_dir is None:
        return None, None
    found = find_image_dir(docker_image_dir, root)
    if found is not None:
        return found, None
    return None, BuiltElsewhere(recipe, docker_image_dir, image_dir_path(docker_image_dir, root))


def built_elsewhere_refusal(
    image: str, image_ids: Mapping[str, str | None], source: BuiltElsewhere
) -> str | None:
    """None when every node holds `image` with one image ID (it is then used as it is);
    else why the recipe cannot be deployed: the nodes that lack the image or differ, the fix."""
    held = {image_id for image_id in image_ids.values() if image_id}
    missing = [node for node, image_id in image_ids.items() if image_id is None]
    if not missing and len(held) == 1:
        return None
    problems = [f"missing on {', '.join(missing)}"] if missing else []
    if len(held) > 1:
        problems.append(
            "different images on "
            + ", ".join(
                f"{node} ({image_id[:19]})" for node, image_id in image_ids.items() if image_id
            )
        )
    return (
        f"recipe {source.recipe}: {image} cannot be built here, since its docker_image_dir"
        f" {source.docker_image_dir!r} names {source.missing}, which this checkout does not have;"
        f" and it is not on every node with one image ID: {'; '.join(problems)}. Fix: "
        + image_dir_fix(source.docker_image_dir, image)
        + f", or put {image} on every node by hand (the same image ID everywhere)"
    )


def build_context(image_dir: Path) -> BuildContext:
    """The directory as a tar build context; ImageError when it is no Docker build context."""
    if not (image_dir / "Dockerfile").is_file():
        raise ImageError(
            f"{image_dir}: no Dockerfile in the recipe's docker_image_dir; put the Dockerfile at"
            " the top of that directory"
        )
    digest = hashlib.sha256()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for path in sorted(image_dir.rglob("*")):
            relative = path.relative_to(image_dir).as_posix()
            mode = path.lstat().st_mode
            info = tar.gettarinfo(str(path), arcname=relative)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            digest.update(f"{relative}\0{stat.S_IMODE(mode):o}\0{stat.S_IFMT(mode):o}\0".encode())
            if path.is_symlink():
                digest.update(os.readlink(path).encode())
                tar.addfile(info)
            elif path.is_file():
                content = path.read_bytes()
                digest.update(hashlib.sha256(content).digest())
                tar.addfile(info, io.BytesIO(content))
            else:
                tar.addfile(info)
    return BuildContext(buffer.getvalue(), digest.hexdigest())
