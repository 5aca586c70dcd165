"""reconfigure()'s requests: the newest one waits here until the step boundary it names.

`reconfigure()` may be called from any thread (the transport's control thread applies autobyted's
decisions); the training thread takes a due request at `step()` (rank 0's is broadcast to every rank
by the dispatcher, engine.py). A newer request replaces a pending one; omitted values are taken from
the pending request if there is one, else from the configuration in effect.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from autobyte.types import Config


class ConfigRequests:
    """The pending request (module docstring), under a lock of its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: tuple[Config, int, int] | None = None  # (config, decision, first step)

    def request(
        self, edit: Callable[[Config], Config], in_effect: Config, decision_id: int, at_step: int
    ) -> Config:
        """Replace the pending request by `edit` of it (of `in_effect` when none is pending), for
        step `at_step` or later; returns the requested configuration."""
        with self._lock:
            new = edit(self._pending[0] if self._pending is not None else in_effect)
            self._pending = (new, decision_id, at_step)
        return new

    def due(self, step: int) -> tuple[Config, int] | None:
        """(config, decision id) of the pending request if it may start at `step` (and it is no
        longer pending), else None."""
        with self._lock:
            if self._pending is None or step < self._pending[2]:
                return None
            config, decision_id, _ = self._pending
            self._pending = None
            return config, decision_id
