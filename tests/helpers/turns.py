"""Whose turn it is when the suite runs two tests at a time (pytest-xdist, scripts/test.sh).

Most tests check what happened, not how fast, and run beside another test. A test marked `alone`
checks a measurement another test's CPU load would distort (how much communication a backward
exposes, a drift's cause, a cgroup's share of a core): while it runs, no other test does.

A readers-writer lock between the workers, on two lock files in a folder the controller makes:
every test holds `shared.lock` shared; an `alone` test holds it exclusive. `turnstile.lock` keeps
an `alone` test from waiting forever: it takes the turnstile first and keeps it, so the other
worker's next test waits at the turnstile instead of taking the shared lock again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator


class Turns:
    def __init__(self, folder: str) -> None:
        self._turnstile = os.open(os.path.join(folder, "turnstile.lock"), os.O_RDWR | os.O_CREAT)
        self._shared = os.open(os.path.join(folder, "shared.lock"), os.O_RDWR | os.O_CREAT)

    @contextlib.contextmanager
    def hold(self, alone: bool) -> Iterator[None]:
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._shared, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        except BaseException:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
            raise
        if not alone:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._shared, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(self._turnstile, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._turnstile)
        os.close(self._shared)
