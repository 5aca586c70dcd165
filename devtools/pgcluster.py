"""A throwaway PostgreSQL cluster (initdb + pg_ctl from the system's server package) for tests and
benchmarks: a temp folder, a free loopback port, its unix socket inside that folder, stopped and
deleted by `stop()` (also after a failed start).

    cluster = PgCluster.start()           # raises PgUnavailable when no server package is installed
    url = cluster.create_database("t1")    # postgresql+psycopg://postgres@127.0.0.1:PORT/t1
    cluster.drop_database("t1")
    cluster.stop()

As root the server runs as the `postgres` user (initdb refuses root): the folder is handed to it.
Authentication is `trust` on loopback and the socket only: this cluster holds nothing of value and
lives as long as one test session or one benchmark.
"""

from __future__ import annotations

import glob
import os
import pathlib
import pwd
import re
import shutil
import subprocess
import tempfile

from devtools.ports import free_port

SERVER_USER = "postgres"
# fsync=off and friends make a test cluster several times faster to write; a benchmark passes
# durable=True to measure what a deployment would see.
FAST_SETTINGS = ("fsync=off", "synchronous_commit=off", "full_page_writes=off")


class PgUnavailable(RuntimeError):
    """No PostgreSQL server binaries here (scripts/setup.sh installs the `postgresql` package)."""


def server_bindir() -> pathlib.Path:
    """The folder of initdb/pg_ctl: `pg_config --bindir` when it has them, else Debian's
    /usr/lib/postgresql/<version>/bin (newest version first)."""
    candidates = []
    if shutil.which("pg_config"):
        try:
            candidates.append(
                subprocess.run(
                    ["pg_config", "--bindir"],
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=10,
                ).stdout.strip()
            )
        except (subprocess.SubprocessError, OSError):
            pass
    candidates += sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda p: [int(n) for n in re.findall(r"\d+", p)],
        reverse=True,
    )
    for folder in candidates:
        path = pathlib.Path(folder)
        if (path / "initdb").exists() and (path / "pg_ctl").exists():
            return path
    raise PgUnavailable(
        "no PostgreSQL server found (initdb/pg_ctl): install the `postgresql` package "
        "(scripts/setup.sh does as root: apt-get install postgresql)"
    )


class PgCluster:
    """Constructed by `start()`; `stop()` stops the server and deletes its folder."""

    def __init__(
        self, folder: pathlib.Path, port: int, bindir: pathlib.Path, as_user: list[str]
    ) -> None:
        self.folder, self.port, self.bindir, self._as_user = folder, port, bindir, as_user
        self.data = folder / "data"
        self.socket_dir = folder / "socket"
        self._counter = 0

    @classmethod
    def start(cls, durable: bool = False, settings: tuple[str, ...] = ()) -> PgCluster:
        bindir = server_bindir()
        folder = pathlib.Path(tempfile.mkdtemp(prefix="autobyte-pg-"))
        as_user: list[str] = []
        if os.geteuid() == 0:  # initdb refuses to run as root
            try:
                user = pwd.getpwnam(SERVER_USER)
            except KeyError:
                shutil.rmtree(folder, ignore_errors=True)
                raise PgUnavailable(
                    f"running as root needs the {SERVER_USER!r} user that the postgresql "
                    "package creates"
                ) from None
            os.chown(folder, user.pw_uid, user.pw_gid)
            as_user = ["runuser", "-u", SERVER_USER, "--"]
        cluster = cls(folder, free_port(), bindir, as_user)
        try:
            cluster._init_and_start(durable, settings)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _run(self, *args: str, timeout_s: float = 60.0) -> None:
        result = subprocess.run(
            [*self._as_user, *args], capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if result.returncode:
            raise RuntimeError(
                f"{' '.join(args[:2])} failed ({result.returncode}): "
                f"{(result.stdout + result.stderr).strip()[-2000:]}"
            )

    def _init_and_start(self, durable: bool, settings: tuple[str, ...]) -> None:
        self._run(
            str(self.bindir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            SERVER_USER,
            "--auth=trust",
            "--encoding=UTF8",
            "--no-locale",
            "--no-sync",
        )
        self._run("mkdir", "-p", str(self.socket_dir))
        options = [
            f"-p {self.port}",
            "-c listen_addresses=127.0.0.1",
            f"-c unix_socket_directories={self.socket_dir}",
            "-c max_connections=300",
        ]
        options += [f"-c {s}" for s in (() if durable else FAST_SETTINGS) + tuple(settings)]
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.folder / "server.log"),
            "-w",
            "-t",
            "60",
            "-o",
            " ".join(options),
            "start",
            timeout_s=90,
        )

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{SERVER_USER}@127.0.0.1:{self.port}/{database}"

    def _admin(self, statement: str) -> None:
        import psycopg

        with psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user=SERVER_USER,
            dbname="postgres",
            autocommit=True,
            connect_timeout=10,
        ) as connection:
            connection.execute(statement)

    def create_database(self, name: str | None = None) -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        if name is None:
            self._counter += 1
            name = f"t{os.getpid()}_{self._counter}"
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", name):
            raise ValueError(f"database name {name!r} must be a lowercase identifier")
        self._admin(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, name_or_url: str) -> None:
        name = name_or_url.rsplit("/", 1)[-1]
        self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        """Stop the server (fast shutdown, immediate if that hangs) and delete everything."""
        if (self.data / "postmaster.pid").exists():
            for mode in ("fast", "immediate"):
                try:
                    self._run(
                        str(self.bindir / "pg_ctl"),
                        "-D",
                        str(self.data),
                        "-m",
                        mode,
                        "-w",
                        "-t",
                        "30",
                        "stop",
                        timeout_s=40,
                    )
                    break
                except (RuntimeError, subprocess.TimeoutExpired):
                    continue
        shutil.rmtree(self.folder, ignore_errors=True)
