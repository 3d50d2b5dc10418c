"""The engine stand-in image, built without internet from what this machine has.

Root: busybox-static, the venv's base python3 (interpreter, a trimmed stdlib and every shared
library ldd names for it and its extension modules), the stand-in's sources in /opt/standin and
`/usr/local/bin/vllm`. The root is written as a deterministic tar (sorted, mtime 0, root-owned),
so its sha256 identifies the content: the image is tagged with it, and a registry that already
holds that tag as `latest` is left alone.

The tar is imported by node 1's dockerd and pushed from there to the lab registry as
`lab/vllm-standin:latest`, through docker-py on that dockerd's Engine API socket; every node's
dockerd uses the registry as its docker.io mirror, so the docker.io-style name pulls on every node.
"""

from __future__ import annotations

import hashlib
import io
import os
import py_compile
import re
import shutil
import sys
import sysconfig
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import docker
from docker.errors import DockerException

from lab.cluster import Lab
from lab.layout import ENGINE_IMAGE, REPO_ROOT
from lab.processes import run
from sparkdeploy.errors import LabError
from sparkdeploy.spec.project import lab_root

BUSYBOX = Path("/usr/bin/busybox")
IMAGE_PYTHON_PREFIX = PurePosixPath("/usr/local")
STANDIN_DIR = PurePosixPath("/opt/standin")
PUSH_TIMEOUT_S = 120
# Outside every lab's state dir, so a new lab (whose registry starts empty) skips the build.
IMAGE_CACHE_DIR = lab_root() / "image-cache"
# Not needed to run the stand-in, and the bulk of a stdlib.
STDLIB_SKIPPED_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "tkinter",
        "turtledemo",
        "ensurepip",
        "lib2to3",
        "site-packages",
        "__pycache__",
        "pydoc_data",
    }
)
STDLIB_SKIPPED_PREFIXES = ("config-",)
# Extension modules the stand-in never imports that pull in big libraries (or are tests).
DYNLOAD_SKIPPED = re.compile(
    r"_test\w*|_ctypes_test|_tkinter|xx\w*|_sqlite3|_curses\w*|readline|_dbm|_gdbm|nis"
)
VLLM_LAUNCHER = f'#!/bin/sh\nexec python3 {STANDIN_DIR}/vllm_standin.py "$@"\n'
IMAGE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONPATH": str(STANDIN_DIR),
}


class _RootTar:
    """Collects the image's files and writes them as a reproducible tar."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[bytes, int]] = {}
        self._links: dict[str, str] = {}
        self._dirs: dict[str, int] = {}

    def add_dir(self, path: PurePosixPath | str, mode: int = 0o755) -> None:
        self._dirs[str(path).lstrip("/")] = mode

    def add_bytes(self, path: PurePosixPath | str, data: bytes, mode: int = 0o644) -> None:
        self._files[str(path).lstrip("/")] = (data, mode)

    def add_symlink(self, path: PurePosixPath | str, target: str) -> None:
        self._links[str(path).lstrip("/")] = target

    def add_host_file(self, host_path: Path, image_path: PurePosixPath | str) -> None:
        self.add_bytes(image_path, host_path.read_bytes(), host_path.stat().st_mode & 0o777)

    def add_host_path_with_links(self, host_path: str) -> None:
        """Copy a file to the same path in the image, recreating each symlink on the way.

        /lib64/ld-linux-x86-64.so.2 on a merged-/usr host is two links deep; the interpreter
        path baked into the binaries must resolve the same way in the image.
        """
        parts = PurePosixPath(host_path).parts
        current = PurePosixPath("/")
        for position, part in enumerate(parts[1:], start=1):
            current = current / part
            if Path(current).is_symlink():
                target = os.readlink(current)
                self.add_symlink(current, target)
                resolved = os.path.normpath(
                    PurePosixPath(current.parent, target).joinpath(*parts[position + 1 :])
                )
                self.add_host_path_with_links(resolved)
                return
        self.add_host_file(Path(current), current)

    def write(self) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
            directories = set(self._dirs)
            for path in [*self._files, *self._links]:
                directories.update(str(parent) for parent in PurePosixPath(path).parents)
            directories.discard(".")
            for path in sorted(directories):
                if path in self._links:
                    continue
                tar.addfile(self._member(path, tarfile.DIRTYPE, self._dirs.get(path, 0o755)))
            for path in sorted(self._links):
                member = self._member(path, tarfile.SYMTYPE, 0o777)
                member.linkname = self._links[path]
                tar.addfile(member)
            for path in sorted(self._files):
                data, mode = self._files[path]
                member = self._member(path, tarfile.REGTYPE, mode)
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
        return buffer.getvalue()

    @staticmethod
    def _member(path: str, kind: bytes, mode: int) -> tarfile.TarInfo:
        member = tarfile.TarInfo(path)
        member.type = kind
        member.mode = mode
        member.mtime = 0
        member.uid = member.gid = 0
        member.uname = member.gname = "root"
        return member


def _shared_libraries(binaries: list[Path]) -> set[str]:
    """The paths ldd resolves for the binaries (the dynamic loader included), in one ldd run."""
    output = run(["ldd", *map(str, binaries)])
    return set(re.findall(r"(/\S+)\s+\(0x", output))


def _stdlib_files(stdlib: Path) -> Iterator[Path]:
    for directory, subdirs, files in os.walk(stdlib):
        subdirs[:] = sorted(
            name
            for name in subdirs
            if name not in STDLIB_SKIPPED_DIRS and not name.startswith(STDLIB_SKIPPED_PREFIXES)
        )
        for name in sorted(files):
            if name.endswith((".pyc", ".exe")) or DYNLOAD_SKIPPED.fullmatch(name.split(".")[0]):
                continue
            yield Path(directory, name)


@dataclass(frozen=True)
class ImageInputs:
    """Everything the image is made of, as found on this machine."""

    interpreter: Path
    python_prefix: Path
    stdlib: Path
    stdlib_files: tuple[Path, ...]
    standin_sources: tuple[tuple[Path, str], ...]

    @classmethod
    def find(cls) -> ImageInputs:
        interpreter = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
        stdlib = Path(sysconfig.get_path("stdlib"))
        engine_dir = REPO_ROOT / "lab" / "engine"
        if not (engine_dir / "vllm_standin.py").exists():
            raise LabError(
                f"{engine_dir / 'vllm_standin.py'} is missing: the image's `vllm` runs it;"
                " restore lab/engine/ from git"
            )
        sources = [(path, path.name) for path in sorted(engine_dir.glob("*.py"))]
        sources += [
            (REPO_ROOT / "sparkdeploy" / "node" / "engram.py", "engram.py"),
            (REPO_ROOT / "sparkdeploy" / "errors.py", "errors.py"),
            (REPO_ROOT / "sparkdeploy" / "vllm" / "kv_cache.py", "kv_cache.py"),
            (REPO_ROOT / "lab" / "tinymodel.py", "tinymodel.py"),
        ]
        return cls(
            interpreter=interpreter,
            python_prefix=Path(sys.base_prefix).resolve(),
            stdlib=stdlib,
            stdlib_files=tuple(_stdlib_files(stdlib)),
            standin_sources=tuple(sources),
        )

    def fingerprint(self) -> str:
        """Changes whenever the image would: this builder, a source, a host file's size or mtime.

        Cheap enough to check on every call, unlike building the tar (ldd, strip, compile).
        """
        digest = hashlib.sha256(Path(__file__).read_bytes())
        for path in (BUSYBOX, self.interpreter, *self.stdlib_files):
            stat = path.stat()
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        for path, name in self.standin_sources:
            digest.update(name.encode() + b"\0" + path.read_bytes())
        return digest.hexdigest()[:16]


def _python_bytecode(source_files: dict[PurePosixPath, Path], workdir: Path) -> dict[str, bytes]:
    """Unchecked-hash .pyc for each image .py: valid whatever the mtimes, so no container
    compiles the stdlib at start (seconds per engine container on a small machine)."""
    bytecode = {}
    compiled = workdir / "module.pyc"
    for image_path, host_path in source_files.items():
        try:
            py_compile.compile(
                str(host_path),
                cfile=str(compiled),
                dfile=str(image_path),
                doraise=True,
                invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
            )
        except py_compile.PyCompileError:
            # Grammar samples and templates in the stdlib that are not meant to compile.
            continue
        cache_name = f"{image_path.stem}.{sys.implementation.cache_tag}.pyc"
        bytecode[str(image_path.parent / "__pycache__" / cache_name)] = compiled.read_bytes()
    return bytecode


def _stripped(binaries: dict[PurePosixPath, Path], workdir: Path) -> dict[PurePosixPath, bytes]:
    """The binaries without debug symbols (a pyenv libpython is mostly symbols), in one strip
    run; unchanged when this machine has no `strip` (binutils)."""
    copies = {}
    for number, (image_path, host_path) in enumerate(sorted(binaries.items())):
        copy = workdir / f"{number}-{host_path.name}"
        shutil.copyfile(host_path, copy)
        copies[image_path] = copy
    strip = shutil.which("strip")
    if strip is not None and copies:
        run([strip, "--strip-unneeded", *map(str, copies.values())], timeout=60)
    return {image_path: copy.read_bytes() for image_path, copy in copies.items()}


def engine_root_tar(inputs: ImageInputs) -> bytes:
    """The image's root filesystem as a reproducible tar."""
    root = _RootTar()
    for directory in ("usr/bin", "usr/lib", "usr/lib64"):
        root.add_dir(directory)
    for link, target in (("bin", "usr/bin"), ("sbin", "usr/bin"), ("lib", "usr/lib")):
        root.add_symlink(link, target)
    for directory in ("etc", "proc", "sys", "dev", "root", "run", "var"):
        root.add_dir(directory, 0o700 if directory == "root" else 0o755)
    root.add_dir("tmp", 0o1777)
    root.add_symlink("var/tmp", "/tmp")
    root.add_bytes("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
    root.add_bytes("etc/group", b"root:x:0:\n")
    root.add_host_file(BUSYBOX, "usr/bin/busybox")
    for applet in run([str(BUSYBOX), "--list"]).split():
        if applet != "busybox":
            root.add_symlink(f"usr/bin/{applet}", "busybox")

    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    image_bin = IMAGE_PYTHON_PREFIX / "bin"
    image_stdlib = IMAGE_PYTHON_PREFIX / "lib" / version
    root.add_symlink(image_bin / "python3", version)
    root.add_symlink(image_bin / "python", version)
    python_sources: dict[PurePosixPath, Path] = {}
    python_binaries = {image_bin / version: inputs.interpreter}
    for path in inputs.stdlib_files:
        image_path = image_stdlib / path.relative_to(inputs.stdlib).as_posix()
        if path.suffix == ".so":
            python_binaries[image_path] = path
        else:
            root.add_host_file(path, image_path)
            if path.suffix == ".py":
                python_sources[image_path] = path
    for library in sorted(_shared_libraries(list(python_binaries.values()))):
        if Path(library).resolve().is_relative_to(inputs.python_prefix):
            # libpython, found through the interpreter's RUNPATH at this same path.
            python_binaries[PurePosixPath(library)] = Path(library).resolve()
        else:
            root.add_host_path_with_links(library)
    for host_path, name in inputs.standin_sources:
        root.add_host_file(host_path, STANDIN_DIR / name)
        python_sources[STANDIN_DIR / name] = host_path
    root.add_bytes(image_bin / "vllm", VLLM_LAUNCHER.encode(), 0o755)

    with tempfile.TemporaryDirectory(prefix="lab-image-") as workdir:
        for image_path, data in _stripped(python_binaries, Path(workdir)).items():
            root.add_bytes(image_path, data, 0o755)
        for pyc_path, data in _python_bytecode(python_sources, Path(workdir)).items():
            root.add_bytes(pyc_path, data)
    return root.write()


def registry_digest(lab: Lab, repository: str, tag: str) -> str | None:
    request = urllib.request.Request(
        f"http://{lab.registry}/v2/{repository}/manifests/{tag}",
        method="HEAD",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            digest: str | None = reply.headers.get("Docker-Content-Digest")
            return digest
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise LabError(
            f"lab registry {lab.registry} answered {error.code} for {repository}:{tag}"
        ) from error
    except OSError as error:
        raise LabError(
            f"lab registry {lab.registry} unreachable: {error}; is the lab up"
            f" (`python -m lab status --name {lab.name}`)?"
        ) from error


def push_root_tar(
    lab: Lab,
    tar: Path,
    *,
    repository: str,
    tag: str,
    content_tag: str,
    env: dict[str, str],
    progress: Callable[[str], None] | None = None,
) -> str:
    """Make `repository:tag` in the lab registry the image of this root tar; returns its name.

    Idempotent: the image is also tagged `content_tag` (a digest of its inputs), and nothing is
    imported or pushed when the registry's `tag` already is that image.
    """
    pushed = registry_digest(lab, repository, content_tag)
    if pushed is not None and pushed == registry_digest(lab, repository, tag):
        return f"{repository}:{tag}"
    if progress is not None:
        progress(f"importing {tar.name} ({tar.stat().st_size / 2**20:.0f} MiB) as {repository}")
    local_name = f"{lab.registry}/{repository}"
    changes = [f"ENV {key}={value}" for key, value in env.items()]
    changes.append(f"LABEL lab.inputs-sha256={content_tag}")
    engine = docker.DockerClient(
        base_url=f"unix://{lab.docker_socket(lab.nodes[0])}", timeout=PUSH_TIMEOUT_S
    )
    try:
        engine.api.import_image(
            src=str(tar), repository=local_name, tag=content_tag, changes=changes
        )
        engine.api.tag(f"{local_name}:{content_tag}", local_name, tag=tag)
        for name in (content_tag, tag):
            _push(engine, local_name, name)
    except DockerException as error:
        raise LabError(f"pushing {repository} to {lab.registry} failed: {error}") from error
    finally:
        engine.close()
    if progress is not None:
        progress(f"{repository}:{tag} pushed to the lab registry")
    return f"{repository}:{tag}"


def _push(engine: docker.DockerClient, local_name: str, tag: str) -> None:
    """docker push; the Engine API reports a failed push inside its progress stream, not as an
    HTTP error, so the stream is read to its end."""
    for message in engine.api.push(local_name, tag=tag, stream=True, decode=True):
        if "error" in message:
            raise LabError(f"pushing {local_name}:{tag}: {message['error']}")


def build_engine_image(lab: Lab) -> str:
    """Make `lab/vllm-standin:latest` in the lab registry hold the current stand-in.

    Returns the image name the recipes use. Idempotent: the image is tagged with the fingerprint of
    its inputs, and nothing is built or pushed when the registry's `latest` is that tag.
    """
    inputs = ImageInputs.find()
    content_tag = inputs.fingerprint()
    pushed = registry_digest(lab, ENGINE_IMAGE, content_tag)
    if pushed is not None and pushed == registry_digest(lab, ENGINE_IMAGE, "latest"):
        return f"{ENGINE_IMAGE}:latest"
    cached_tar = IMAGE_CACHE_DIR / f"vllm-standin-{content_tag}.tar"
    if not cached_tar.exists():
        tar = engine_root_tar(inputs)
        IMAGE_CACHE_DIR.mkdir(parents=True, exist_ok=True)
        for stale in IMAGE_CACHE_DIR.glob("vllm-standin-*.tar"):
            stale.unlink()
        partial = cached_tar.with_suffix(".partial")
        partial.write_bytes(tar)
        partial.rename(cached_tar)
    return push_root_tar(
        lab,
        cached_tar,
        repository=ENGINE_IMAGE,
        tag="latest",
        content_tag=content_tag,
        env=IMAGE_ENV,
    )


__all__ = ["build_engine_image", "engine_root_tar", "push_root_tar", "registry_digest"]
