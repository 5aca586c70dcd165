"""What a `ScheduledOptimizer` was asked for besides its model, optimizers and sizes: fixed at
construction (checked there: checks.check_setup), read by the engine built at the first step
(engine.build) and by the waits of the training thread."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Settings:
    clip: float | None  # clip_grad_norm: the global norm the reduced gradients are clipped to
    clip_norm_type: float
    timeout_s: float  # how long the training thread waits for parameters or shutdown
    native: bool  # the C++ hot path where it can run (engine.build chooses on every rank alike)
    scaler: Any  # the GradScaler given (None: none)
