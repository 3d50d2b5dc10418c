"""A PostgreSQL server of our own for Prefect's database: Debian's `postgresql` binaries, a
cluster in a data directory of ours, started without systemd and stopped by PID.

Prefect documents PostgreSQL (asyncpg) as the database for shared use
(https://docs.prefect.io/v3/advanced/self-hosted: PREFECT_SERVER_DATABASE_CONNECTION_URL);
SQLite stays the embedded default of the demo and the tests. The server listens on the address
given (loopback) and trusts the connections it gets there: it is a test and demo database,
never a team's.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from lab.processes import start_logged, stop_process_group, wait_until_ready
from sparkdeploy.errors import LabError

POSTGRES_USER = "postgres"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
# Prefect's server and its workers' flow runs hold a pool each (Prefect's default pool size 5,
# overflow 10); four concurrent deploys over two API servers and a services process fit.
MAX_CONNECTIONS = 300


def _bindir() -> Path:
    """The newest installed PostgreSQL's bin directory (Debian: /usr/lib/postgresql/<v>/bin)."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/postgres"),
        key=lambda path: int(path.parent.parent.name) if path.parent.parent.name.isdigit() else 0,
    )
    if not found:
        raise LabError(
            "PostgreSQL's server is not installed (no /usr/lib/postgresql/*/bin/postgres):"
            " run scripts/setup, which installs Debian's postgresql package"
        )
    return found[-1].parent


def _as_postgres(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root."""
    return ["runuser", "-u", POSTGRES_USER, "--", *argv]


@dataclass
class PostgresServer:
    """`postgres -D data_dir` on host:port; `database_url(name)` creates a database for Prefect."""

    data_dir: Path
    port: int
    host: str = "127.0.0.1"
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / f"{self.data_dir.name}.log"

    def _initialise(self) -> None:
        """initdb, once: a data directory that holds a cluster is reused as it is."""
        if (self.data_dir / "PG_VERSION").exists():
            return
        account = pwd.getpwnam(POSTGRES_USER)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        _check_reachable_by(self.data_dir, account)
        os.chown(self.data_dir, account.pw_uid, account.pw_gid)
        self.data_dir.chmod(0o700)
        subprocess.run(
            _as_postgres(
                [
                    str(_bindir() / "initdb"),
                    "--pgdata",
                    str(self.data_dir),
                    "--username",
                    POSTGRES_USER,
                    "--auth",
                    "trust",
                    "--encoding",
                    "UTF8",
                    "--no-locale",
                ]
            ),
            check=True,
            capture_output=True,
            timeout=120,
        )

    def start(self) -> None:
        self._initialise()
        self.log_path.touch()
        os.chown(self.log_path, *_ids(POSTGRES_USER))
        self._process = start_logged(
            _as_postgres(
                [
                    str(_bindir() / "postgres"),
                    "-D",
                    str(self.data_dir),
                    "-h",
                    self.host,
                    "-p",
                    str(self.port),
                    # The socket next to the data, not /var/run/postgresql (which a fresh
                    # machine without the service's tmpfiles.d setup lacks).
                    "-k",
                    str(self.data_dir),
                    "-c",
                    f"max_connections={MAX_CONNECTIONS}",
                    # A demo and test database: losing the last commit in a machine crash
                    # is fine, and fsync on every commit slows every Prefect write.
                    "-c",
                    "fsync=off",
                    "-c",
                    "synchronous_commit=off",
                ]
            ),
            self.log_path,
        )
        wait_until_ready(
            self._process,
            self._ready,
            name="postgres",
            log_path=self.log_path,
            timeout_s=START_TIMEOUT_S,
            poll_s=0.2,
            stop=self.stop,
        )

    def _ready(self) -> bool:
        result = subprocess.run(
            [str(_bindir() / "pg_isready"), "-h", self.host, "-p", str(self.port), "-q"],
            check=False,
            timeout=10,
        )
        return result.returncode == 0

    def create_database(self, name: str) -> None:
        """The database `name`, created unless it exists (a demo keeps its history)."""
        result = subprocess.run(
            [
                str(_bindir() / "createdb"),
                *("-h", self.host, "-p", str(self.port), "-U", POSTGRES_USER),
                name,
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if result.returncode != 0 and "already exists" not in result.stderr:
            raise LabError(f"createdb {name} failed: {result.stderr.strip()}")

    def database_url(self, name: str) -> str:
        """What PREFECT_SERVER_DATABASE_CONNECTION_URL takes for the database `name`."""
        return f"postgresql+asyncpg://{POSTGRES_USER}@{self.host}:{self.port}/{name}"

    def stop(self) -> None:
        """A fast shutdown (SIGINT: running transactions are rolled back), then SIGKILL."""
        process, self._process = self._process, None
        if process is None:
            return
        # runuser forwards the signal to postgres and waits for it.
        stop_process_group(process, first_signal=signal.SIGINT, grace_s=STOP_TIMEOUT_S)

    def remove(self) -> None:
        """Stopped, and its data directory gone."""
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _ids(user: str) -> tuple[int, int]:
    account = pwd.getpwnam(user)
    return account.pw_uid, account.pw_gid


def _check_reachable_by(directory: Path, account: pwd.struct_passwd) -> None:
    """The postgres user must pass through every parent of its data directory."""
    for parent in directory.resolve().parents:
        mode = parent.stat().st_mode
        if not mode & 0o001 and parent.stat().st_uid != account.pw_uid:
            raise LabError(
                f"the {POSTGRES_USER} user cannot reach {directory}: {parent} is not"
                f" searchable by others (mode {mode & 0o777:o}); put the data directory under"
                " a world-searchable path such as the lab root"
            )
