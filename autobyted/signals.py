"""The signals a job's steps carry about their conditions (bandwidth, compute, host load, step
time), with the shift of each that matters: shared by the tuner's drift detection
(autobyted/tuner/drift.py) and the daemon's context split of stored steps (autobyted/contexts.py),
so that neither the storage nor the query side imports the tuner."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence

from autobyte.types import StepMetrics


@dataclasses.dataclass(frozen=True)
class Signal:
    name: str  # what is measured: bandwidth, compute, host_load, step_time
    extract: Callable[[StepMetrics], float]  # NaN: not measured in this sample
    min_shift: float
    sigma_floor: float
    rise: str  # how an upward shift reads in a reason ("re-tuning after bandwidth rise")
    fall: str
    rank: int | None = None  # one rank's own value (compute per rank); None: the job's

    @property
    def key(self) -> str:
        return self.name if self.rank is None else f"{self.name}@{self.rank}"


def log_or_nan(value: float) -> float:
    """log(value), NaN for a value that is not positive (not measured)."""
    return math.log(value) if value > 0 else math.nan


SIGNALS = (
    Signal(
        "bandwidth",
        lambda m: log_or_nan(m.bandwidth_bytes_per_s),
        0.25,
        0.02,
        "bandwidth rise",
        "bandwidth drop",
    ),
    Signal(
        "compute",
        lambda m: log_or_nan(m.forward_s + m.backward_s),
        0.15,
        0.01,
        "compute slowdown",
        "compute speed-up",
    ),
    Signal(
        "host_load",
        lambda m: m.host_load if m.host_load > 0 else math.nan,
        0.2,
        0.02,
        "host load rise",
        "host load drop",
    ),
    Signal(
        "step_time",
        lambda m: log_or_nan(m.step_time_s),
        0.10,
        0.01,
        "step time rise",
        "step time drop",
    ),
)


def robust_sigma(values: Sequence[float]) -> float:
    median = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - median) for v in values)
