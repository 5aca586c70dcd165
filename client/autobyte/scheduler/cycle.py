"""Where the training thread is in the step cycle: the state `ScheduledOptimizer`'s hooks read and
write on the training thread (forward pre-hooks, gradient hooks, `.grad` reads and writes, `step`).

Steps are counted by `step()` calls (and by a second synchronising backward before one, which
re-reduces the accumulated gradients as DDP does: optimizer._carry_over); every per-parameter list holds, for parameter i in the
scheduler's own numbering (checks.managed), the step in which something last happened to it, so
that "did it happen in this step" is one comparison and nothing is cleared between steps. Only the
training thread touches it (the dispatcher and updater threads have their own state: engine.py).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepCycle:
    """The step cycle's state (module docstring); `n` parameters."""

    n: int
    index: int = 0  # steps so far: step() calls, and second synchronising backwards (carry)
    # First-use order: parameters in the order the first forward pass reached them (None once the
    # layout is fixed at the first backward pass); recording from the first forward until then.
    order: list[int] | None = dataclasses.field(default_factory=list)
    recording: bool = False
    seen: list[bool] = dataclasses.field(init=False)
    read_step: list[int] = dataclasses.field(init=False)  # step of each parameter's last read
    local_used: list[int] = dataclasses.field(init=False)  # step this rank last produced its grad
    cleared: list[int] = dataclasses.field(init=False)  # step whose grad zero_grad()/None cleared
    forward_seen: int = -1  # step whose first forward has been checked
    backward_end_queued: int = -1  # step whose end-of-backward callback is queued
    backward_done: int = -1  # step whose (synchronising) backward pass has ended
    read_synced: int = -1  # step whose gradients a read of `.grad` has waited for
    # scaler.unscale_(optimizer) calls of a step: (step, the optimizers unscaled in it)
    unscaled_by: tuple[int, list] = (-1, [])

    def __post_init__(self) -> None:
        self.seen = [False] * self.n
        self.read_step = [-1] * self.n
        self.local_used = [-1] * self.n
        self.cleared = [-1] * self.n
