"""Process-wide cleanup of live testbeds: on exit (atexit) and on SIGTERM/SIGHUP."""

from __future__ import annotations

import atexit
import itertools
import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.testbed.bed import Testbed

logger = logging.getLogger(__name__)


_LIVE: set[Testbed] = set()
_LIVE_LOCK = threading.RLock()
_PREVIOUS_HANDLERS: dict[int, Any] = {}
_SEQ = itertools.count()


def _close_all_live() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for bed in live:
        try:
            bed.close()
        except Exception:  # cleanup of one must not stop cleanup of the others
            logger.exception("testbed cleanup failed for %s", bed.name)


def _on_signal(signum: int, frame: Any) -> None:
    _close_all_live()
    previous = _PREVIOUS_HANDLERS.get(signum)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        raise SystemExit(128 + signum)


def _register(bed: Testbed) -> None:
    with _LIVE_LOCK:
        first = not _LIVE
        _LIVE.add(bed)
    if first and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            _PREVIOUS_HANDLERS[sig] = signal.signal(sig, _on_signal)


def _unregister(bed: Testbed) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(bed)
        last = not _LIVE
    if last and _PREVIOUS_HANDLERS and threading.current_thread() is threading.main_thread():
        for sig, previous in list(_PREVIOUS_HANDLERS.items()):
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        _PREVIOUS_HANDLERS.clear()


atexit.register(_close_all_live)
