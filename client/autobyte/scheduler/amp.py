"""Loss scaling (`torch.amp.GradScaler`) with the scheduler: the documented path is
`ScheduledOptimizer(..., grad_scaler=scaler)` and then the usual AMP loop:

    with torch.autocast(device_type, dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)        # opt is the ScheduledOptimizer
    scaler.update()

The scaler cannot do its job itself: gradients are in flight when `scaler.step()` runs, and
`param.grad` of managed parameters is None. So the scheduler takes over what GradScaler does after
DDP's backward, on the *reduced* gradients of the whole step, in its update thread: unscale, check for
inf/NaN (the same verdict on every rank: every rank sees the same reduced gradients), skip the whole
step's update if any, then update the scale (growth/backoff). To keep this exact, the bridge installs
instance-level methods on that scaler object (restored by `close()`):
* `scale()` first waits until the previous step's update (and scale update) has landed, so every
  step is scaled with the value GradScaler would use;
* `step(opt)` is `opt.step()`; `update()` is a no-op (the scale was updated with the step;
  `update(new_scale)` sets the scale after synchronising);
* `unscale_(opt)` unscales the reduced gradients of the step (reading `.grad` waits for them:
  `autobyte.scheduler.grad_reads`), so the AMP recipe's `clip_grad_norm_` after it works as after
  DDP's backward; the update then only checks the verdict and updates the scale;
* `get_scale()`, `state_dict()`, `load_state_dict()` synchronise first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from autobyte.scheduler.progress import SchedulerError

_METHODS = ("scale", "step", "update", "unscale_", "get_scale", "state_dict", "load_state_dict")


@dataclasses.dataclass(frozen=True)
class Owner:
    """What the bridge asks of the ScheduledOptimizer that owns the scaler, named here so that it
    reads none of its private members."""

    optimizer: Any  # the ScheduledOptimizer: what `scaler.step(opt)` must be given
    wrapped: Sequence[Any]  # the optimizers it wraps (`scaler.unscale_(opt)` may name one)
    step_index: Callable[[], int]
    step: Callable[[], None]
    synchronize: Callable[[], None]
    synchronize_if_open: Callable[[], None]  # not after close() or a failure
    wait_all_updated: Callable[[], None]  # the previous step's updates (and scale) landed
    unscale_for_loop: Callable[[Any, Any], None]  # (scaler, optimizer): the loop's unscale_


class ScalerBridge:
    def __init__(self, scaler: Any, owner: Owner) -> None:
        self.scaler = scaler
        self.owner = owner
        self.scaled_step = -1
        cls = type(scaler)
        self._cls = cls
        self._saved = {name: scaler.__dict__[name] for name in _METHODS if name in scaler.__dict__}
        for name in _METHODS:
            setattr(scaler, name, getattr(self, name))

    def restore(self) -> None:
        for name in _METHODS:
            self.scaler.__dict__.pop(name, None)
        self.scaler.__dict__.update(self._saved)

    # ------------------------------------------------------------------ the scaler's methods

    def scale(self, outputs: Any) -> Any:
        owner = self.owner
        owner.wait_all_updated()
        self.scaled_step = owner.step_index()
        return self._cls.scale(self.scaler, outputs)

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if optimizer is not self.owner.optimizer:
            raise SchedulerError(
                "this GradScaler belongs to a ScheduledOptimizer: scaler.step() takes "
                "that ScheduledOptimizer (pass every optimizer to it)"
            )
        if args or kwargs:
            raise ValueError(
                "scaler.step(opt) takes no closure or extra arguments with ScheduledOptimizer"
            )
        self.owner.step()

    def update(self, new_scale: Any = None) -> None:
        if new_scale is None:
            return  # updated with the step, in the update thread
        self.owner.synchronize()
        self._cls.update(self.scaler, new_scale)

    def unscale_(self, optimizer: Any) -> None:
        """GradScaler's unscale_ on the reduced gradients of this step (a read of every gradient:
        `grad_reads`), before a clip of the loop's own; the update then skips a step with inf/NaN on
        every rank alike and updates the scale without unscaling again."""
        owner = self.owner
        if optimizer is not owner.optimizer and not any(optimizer is o for o in owner.wrapped):
            raise SchedulerError(
                "this GradScaler belongs to a ScheduledOptimizer: scaler.unscale_() takes "
                "that ScheduledOptimizer or an optimizer it wraps"
            )
        owner.unscale_for_loop(self.scaler, optimizer)

    def get_scale(self) -> float:
        self.owner.synchronize_if_open()
        return self._cls.get_scale(self.scaler)

    def state_dict(self) -> dict:
        self.owner.synchronize_if_open()
        return self._cls.state_dict(self.scaler)

    def load_state_dict(self, state_dict: dict) -> None:
        self.owner.synchronize_if_open()
        self._cls.load_state_dict(self.scaler, state_dict)
