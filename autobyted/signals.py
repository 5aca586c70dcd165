"""The signals a job's steps carry about their conditions (bandwidth, compute, host load, step
time), with the shift of each that matters, and which of several moved signals is a change's
cause (`cause_of`): shared by the tuner's drift detection (autobyted/tuner/drift.py) and the
daemon's context split of stored steps (autobyted/contexts.py), so that both name one change by one
cause and label ("bandwidth drop"), and neither the storage nor the query side imports the tuner."""

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


Z_APART = 2.5  # TunerParams.z_switch: a difference of 2.5 standard errors (~0.6% one-sided)


def cause_of(
    shifts: dict[str, tuple[Signal, float, float]], moved: set[str]
) -> tuple[Signal, float] | None:
    """Which change explains the context signals in `moved` (keys of `shifts`: every watched
    signal's shift and its standard error), by the precedence autobyted/tuner/drift.py's docstring gives its reasons for: one rank's
    compute moving apart from the other ranks' (by its min_shift and by Z_APART standard errors of
    the difference) is that rank's change, and explains a fall of the
    bandwidth estimate (the peers wait for it); otherwise the signal that moved most in units of
    its min_shift, except that compute moving on every rank together with a bandwidth change by
    its min_shift is the link's (on a shared host competing traffic costs every rank CPU)."""
    candidates = [
        shifts[key] for key in sorted(moved) if key in shifts
    ]  # ties: the same pick every run
    if not candidates:
        return None
    per_rank = [item for item in shifts.values() if item[0].rank is not None]
    apart = []
    for signal, shift, se in candidates:
        if signal.rank is None:
            continue
        others = [(x, e) for s, x, e in per_rank if s.rank != signal.rank]
        gap = shift - statistics.median(x for x, _ in others) if others else shift
        noise = math.hypot(se, max((e for _, e in others), default=0.0))
        if abs(gap) >= max(signal.min_shift, Z_APART * noise):
            apart.append((abs(shift) / signal.min_shift, signal, gap, shift))  # 2 ranks: equal gaps
    link = [(s, x) for s, x, _ in candidates if s.name == "bandwidth" and abs(x) >= s.min_shift]
    if apart:
        _, signal, gap, shift = max(apart, key=lambda t: t[0])
        if not link or rank_explains_link(shift, *link[0]):
            return signal, gap
        return link[0]  # the rank moved the other way: the link's traffic moved the rank
    signal, shift, _ = max(candidates, key=lambda t: abs(t[1]) / t[0].min_shift)
    if link and (
        (signal.name == "compute" and per_rank)
        or (signal.name == "host_load" and shift * link[0][1] > 0)
    ):
        return link[0]
    return signal, shift


def rank_explains_link(rank_shift: float, link: Signal, link_shift: float) -> bool:
    """Whether one rank's compute moving by `rank_shift` (log) explains the bandwidth estimate
    moving by `link_shift` (log): a slower rank lowers the estimate (its peers' collectives wait
    for it, and a CPU quota throttles its communication threads too: 4x lower beside a 2.1x
    slowdown), a faster one raises it. A rank speeding up while the estimate falls (or slowing
    while it rises) is not the cause but an effect of the link: on a host whose cores carry the
    job's traffic (gloo's reductions, TCP through the veths) a slower link frees CPU (the quick
    start's 2 Gbit/s -> 300 Mbit/s: rank 0's compute -40%, the estimate 6x lower)."""
    return rank_shift * link_shift < 0


def robust_sigma(values: Sequence[float]) -> float:
    median = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - median) for v in values)
