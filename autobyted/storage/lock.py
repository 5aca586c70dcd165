"""One SQLite database, one daemon: an OS lock on a sidecar file `<database>.lock`.

Two daemons on one SQLite file would each hold their own decisions and wake only their own
clients. The lock is an `fcntl.flock` held for the daemon's lifetime: the kernel releases it when the
process exits, however it exits (a SIGKILLed daemon never leaves a stale lock). Other databases
(PostgreSQL, ...) are not locked here: sharing one of those between daemons is their job.
"""

from __future__ import annotations

import fcntl
import json
import os

from sqlalchemy.engine import make_url

from autobyted.errors import DatabaseInUse


def sqlite_path(url: str) -> str | None:
    """The file of a SQLite URL, None for any other database."""
    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 - make_engine reports an unparsable URL
        return None
    if (
        parsed.get_backend_name() != "sqlite"
        or not parsed.database
        or parsed.database == ":memory:"
    ):
        return None
    return os.path.abspath(parsed.database)


class DatabaseLock:
    """`acquire()` takes the lock or raises DatabaseInUse naming the holder; `release()` drops it."""

    def __init__(self, url: str, listen: str) -> None:
        self.path = sqlite_path(url)
        self._listen = listen
        self._fd: int | None = None

    def acquire(self) -> None:
        if self.path is None:
            return
        lock_path = self.path + ".lock"
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return  # an unwritable folder: the database open that follows says why, clearly
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise DatabaseInUse(
                f"database {self.path} is in use by another autobyted ({holder}); one SQLite database "
                "serves one daemon: stop the other daemon, point clients at it, or use another --db"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "listen": self._listen}).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        holder = json.loads(os.read(fd, 4096) or b"{}")
        return f"pid {holder['pid']}, listening on {holder['listen']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid unknown"
