"""The end of a training process: every scheduler still open ends before the interpreter stops its threads.

Most DDP scripts never close anything: the loop ends, or `sys.exit(n)`, an exception or Ctrl-C ends
it. A `ScheduledOptimizer` left open then still runs its threads (dispatch, update, the watchdog,
the native engine's) when Python shuts down, and Python stops each daemon thread that next takes
the GIL with `pthread_exit`. Inside C++ frames (gloo's wait, the native engine's GIL release) that
unwinding ends in `std::terminate`: "terminate called without an active exception", SIGABRT, instead
of the script's exit code.

So the first thing shutdown does (threading's own exit hooks run before `atexit` and before any
thread is stopped, while torch.distributed's groups are still alive) is to end every open scheduler
(the `end` each registers with `track`: `ScheduledOptimizer._end_at_exit`): its updates in flight
land, as DDP's have when `step()` returns — bounded by `EXIT_BUDGET_S`, so that a dead or diverged peer never holds the process — then its
threads stop. `dist.destroy_process_group()` ends the schedulers on the groups it destroys first,
for the same reason (see `end_before_destroy`).
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# How long one process's exit may wait for its schedulers' updates in flight and threads: within it
# a healthy peer finishes the step's collectives (milliseconds), and a dead one has been named by the
# watchdog (`autobyte.scheduler.health`, dead_s = 6 s); a rank is gone within 10 s of its end.
EXIT_BUDGET_S = 8.0

# open scheduler -> its ending (a weak method: tracking never keeps a scheduler alive)
_open: weakref.WeakKeyDictionary[Any, weakref.WeakMethod] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_hooked = False


def track(scheduler: Any, end: Callable[[float], None]) -> None:
    """A scheduler started its threads: `end(budget_s)` it at exit, or before its groups are
    destroyed (`end` a method of the scheduler)."""
    global _hooked
    with _lock:
        _open[scheduler] = weakref.WeakMethod(end)
        if _hooked:
            return
        _hooked = True
    try:  # before threads are stopped and before atexit (Python >= 3.9)
        threading._register_atexit(end_open_schedulers)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # already shutting down, or another Python
        atexit.register(end_open_schedulers)
    _wrap_destroy_process_group()


def untrack(scheduler: Any) -> None:
    _open.pop(scheduler, None)


def end_open_schedulers(groups: set[Any] | None = None) -> None:
    """End every open scheduler (on one of `groups`, if given); never raises."""
    for scheduler, end in list(_open.items()):
        if groups is not None and scheduler.process_group not in groups:
            continue
        try:
            ending = end()
            if ending is not None:
                ending(EXIT_BUDGET_S)
        except BaseException as error:  # noqa: BLE001 - the process is ending: say why, go on
            logger.warning("while ending the scheduler at exit: %s", error)
        untrack(scheduler)


def _wrap_destroy_process_group() -> None:
    """`dist.destroy_process_group(group)` ends the schedulers on the groups it destroys first."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = distributed_c10d.destroy_process_group
    if getattr(original, "_autobyte_wrapped", False):
        return

    def destroy_process_group(group: Any = None) -> None:
        end_before_destroy(group)
        return original(group)

    destroy_process_group.__doc__ = original.__doc__
    destroy_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    destroy_process_group._autobyte_wrapped = True  # type: ignore[attr-defined]
    distributed_c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def end_before_destroy(group: Any) -> None:
    """Before `destroy_process_group(group)`: the schedulers on it (every one, for the default group
    or None) end, their updates in flight landed, as DDP's have when `step()` returns."""
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        end_open_schedulers()
    else:
        end_open_schedulers({group})
