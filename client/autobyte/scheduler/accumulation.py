"""Gradient accumulation over micro-batches: `with opt.no_sync():` keeps gradients local, as DDP's
`model.no_sync()` does, and the next backward outside it sends their sum.

Inside `no_sync()` the scheduler's gradient hook leaves each gradient in `param.grad`, where
autograd accumulates the micro-batches (exactly DDP's `no_sync`: the same in-place sums); the first
backward outside it (or `step()`, for a parameter that backward did not reach) hands the accumulated
gradient to the scheduler, which partitions and sends it by priority as it appears. Loss scaling
stays the user's: divide each micro-batch's loss by the number of micro-batches, as with DDP.

Misuse raises at the backward that reveals it, naming the parameter: a second backward outside
`no_sync()` in one step (its gradients would be lost: the first already went out), or a backward
inside `no_sync()` after the step's gradients were sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from autobyte.scheduler.progress import SchedulerError


class Accumulation:
    """Whether backward passes accumulate locally now, and which parameters hold a local sum."""

    def __init__(self, n: int) -> None:
        self.active = False
        self.local_step = [-1] * n  # step whose micro-batch gradients param.grad holds

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self.active
        self.active = True
        try:
            yield
        finally:
            self.active = previous

    def keep_local(self, i: int, step: int) -> bool:
        """The gradient hook of parameter i in `step`: True if its gradient stays in `.grad`."""
        if not self.active:
            return False
        self.local_step[i] = step
        return True

    def holds(self, i: int, step: int) -> bool:
        """Parameter i's `.grad` holds micro-batch gradients of `step` not sent yet."""
        return self.local_step[i] == step

    def second_gradient(self, name: str, step: int) -> SchedulerError:
        """The error for a gradient of a parameter whose gradient of `step` was already sent."""
        if self.active:
            return SchedulerError(
                f"parameter {name!r} received a gradient inside no_sync() in step {step} after "
                "this step's gradients were already sent by a backward outside no_sync(): the "
                "synchronising backward must be the last of the step; call step() before the "
                "next micro-batches"
            )
        return SchedulerError(
            f"parameter {name!r} received a second gradient in step {step}: only one backward per "
            "step() may synchronise. For gradient accumulation over micro-batches, run all but "
            "the last backward inside `with opt.no_sync():` (as with DDP's model.no_sync()), or "
            "call step() after each backward"
        )
