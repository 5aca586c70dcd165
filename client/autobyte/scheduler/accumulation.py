"""Gradient accumulation over micro-batches: `with opt.no_sync():` keeps gradients local, as DDP's
`model.no_sync()` does, and the next backward outside it sends their sum.

Which backward passes accumulate is decided at their forward, as DDP decides it (its forward reads
`require_backward_grad_sync`): the backward of a forward run inside `no_sync()` keeps its gradients
local wherever it runs, and that of a forward run outside synchronises even inside it (a loop that
calls a submodule rather than the model: `no_sync()` around the backward decides).

Inside `no_sync()` the scheduler's gradient hook leaves each gradient in `param.grad`, where
autograd accumulates the micro-batches (exactly DDP's `no_sync`: the same in-place sums); the first
backward outside it (or `step()`, for a parameter that backward did not reach) hands the accumulated
gradient to the scheduler, which partitions and sends it by priority as it appears. Loss scaling
stays the user's: divide each micro-batch's loss by the number of micro-batches, as with DDP.

A second synchronising backward in one step all-reduces again, as DDP does (the reduced sum so far
plus its own gradients: `ScheduledOptimizer._carry_over`). Misuse raises at the backward that
reveals it, naming the parameter: a local backward after the step's gradients were sent (DDP would
leave each rank its own unsynchronised sum).
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
        # whether the model's last forward with gradients enabled ran inside no_sync() (None: no
        # forward of the root module seen, e.g. a loop calling a submodule)
        self.forward_local: bool | None = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self.active
        self.active = True
        try:
            yield
        finally:
            self.active = previous

    def after_forward(self, grad_enabled: bool) -> None:
        """The end of a forward pass of the model: DDP decides there whether the backward of its
        graph synchronises (`require_backward_grad_sync`, read in its forward)."""
        if grad_enabled:
            self.forward_local = self.active

    def local(self) -> bool:
        """Whether the backward running now keeps its gradients local: decided at its forward, as
        DDP does, else (no forward of the model seen) by no_sync() around the backward."""
        return self.active if self.forward_local is None else self.forward_local

    def keep_local(self, i: int, step: int) -> bool:
        """The gradient hook of parameter i in `step`: True if its gradient stays in `.grad`."""
        if not self.local():
            return False
        self.local_step[i] = step
        return True

    def holds(self, i: int, step: int) -> bool:
        """Parameter i's `.grad` holds micro-batch gradients of `step` not sent yet."""
        return self.local_step[i] == step

    def second_gradient(self, name: str, step: int) -> SchedulerError:
        """The error for a local gradient of a parameter whose gradient of `step` was sent."""
        return SchedulerError(
            f"parameter {name!r} received a gradient inside no_sync() in step {step} after "
            "this step's gradients were already sent by a backward outside no_sync(): the "
            "synchronising backward must be the last of the step; call step() before the "
            "next micro-batches"
        )
