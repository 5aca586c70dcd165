"""Drift detection while a configuration is held: a two-sided CUSUM (Page's test) per signal.

Signals, per step of the held configuration (rank 0): log step time (the residual against what the
held configuration measured), log of the scheduler's bandwidth estimate, log compute time (forward
+ backward) and the host load (when the client knows it). Each is compared with a reference window
of the *same* configuration, so a signal that depends on the configuration (the bandwidth estimate
does) is still comparable.

For a signal with reference median mu and robust spread sigma (1.4826 x MAD, floored), and a
minimum relevant shift `delta` (a change smaller than that is not worth a re-tune):

    d_t = clip(x_t - mu, -c, c)                 c = k + h/2: one wild step cannot alarm alone
    S+_t = max(0, S+_{t-1} + d_t - k)           k = max(delta/2, sigma/2)
    S-_t = max(0, S-_{t-1} - d_t - k)           h = max(2 delta, 10 sigma)
    alarm when S+ > h or S- > h

Why these constants (first principles, not fitted to any scenario): k = delta/2 is the classic
choice for detecting a shift of size delta; h = 10 sigma with k >= sigma/2 gives an in-control
average run length above 10^5 steps for Gaussian noise (Siegmund's approximation), i.e. well under
one false alarm per hour at 10 steps/s; h >= 2 delta means a shift of exactly delta needs about
four steps to alarm, and the clipping at c needs at least two wild steps in a row. The minimum
shifts: step time 10% (below that a re-tune rarely pays for its trials), bandwidth 25% and compute
15% (changes of the communication/computation balance that move the best partition/credit in the
simulator's and the testbed's maps), host load 0.2 (a fifth of the host's cores taken by others).
`python -m benchmarks.bench_tuner drift` measures the false alarms on stationary runs.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence

from autobyte.types import StepMetrics


@dataclasses.dataclass(frozen=True)
class Signal:
    name: str
    extract: Callable[[StepMetrics], float]  # NaN: not measured in this sample
    min_shift: float
    sigma_floor: float
    rise: str  # how an upward shift reads in a reason ("re-tuning after bandwidth rise")
    fall: str


def _log(value: float) -> float:
    return math.log(value) if value > 0 else math.nan


SIGNALS = (
    Signal("bandwidth", lambda m: _log(m.bandwidth_bytes_per_s), 0.25, 0.02, "bandwidth rise", "bandwidth drop"),
    Signal("compute", lambda m: _log(m.forward_s + m.backward_s), 0.15, 0.01, "compute slowdown", "compute speed-up"),
    Signal("host_load", lambda m: m.host_load if m.host_load > 0 else math.nan, 0.2, 0.02,
           "host load rise", "host load drop"),
    Signal("step_time", lambda m: _log(m.step_time_s), 0.10, 0.01, "step time rise", "step time drop"),
)
MIN_REFERENCE = 5


@dataclasses.dataclass(frozen=True)
class Alarm:
    signal: str
    direction: int  # +1 up, -1 down
    shift: float  # current estimate of the shift (median of the last steps minus the reference)
    reason: str


class Cusum:
    """Two-sided CUSUM on one signal against a fixed reference (see the module docstring)."""

    def __init__(self, mu: float, sigma: float, min_shift: float) -> None:
        self.mu = mu
        self.k = max(min_shift / 2, sigma / 2)
        self.h = max(2 * min_shift, 10 * sigma)
        self.clip = self.k + self.h / 2
        self.up = 0.0
        self.down = 0.0

    def update(self, x: float) -> int:
        """+1 / -1 on an alarm upward / downward, else 0."""
        d = min(self.clip, max(-self.clip, x - self.mu))
        self.up = max(0.0, self.up + d - self.k)
        self.down = max(0.0, self.down - d - self.k)
        if self.up > self.h:
            return 1
        if self.down > self.h:
            return -1
        return 0


def robust_sigma(values: Sequence[float]) -> float:
    median = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - median) for v in values)


class DriftDetector:
    """CUSUMs of every signal against a reference window of the held configuration."""

    def __init__(self, reference: Sequence[StepMetrics], signals: Sequence[Signal] = SIGNALS) -> None:
        self._tests: list[tuple[Signal, Cusum]] = []
        self._recent: dict[str, list[float]] = {}
        for signal in signals:
            values = [v for v in map(signal.extract, reference) if math.isfinite(v)]
            if len(values) < MIN_REFERENCE:
                continue  # not measured (e.g. host load from an older client): not watched
            sigma = max(signal.sigma_floor, robust_sigma(values))
            self._tests.append((signal, Cusum(statistics.median(values), sigma, signal.min_shift)))
            self._recent[signal.name] = []

    @property
    def watched(self) -> tuple[str, ...]:
        return tuple(signal.name for signal, _ in self._tests)

    def update(self, sample: StepMetrics) -> Alarm | None:
        """Feed one step; the first signal to alarm (in SIGNALS order: the context before the
        step-time residual, so the reason names the cause when the cause is visible)."""
        alarms = []
        for signal, test in self._tests:
            x = signal.extract(sample)
            if not math.isfinite(x):
                continue
            recent = self._recent[signal.name]
            recent.append(x)
            del recent[:-5]
            direction = test.update(x)
            if direction:
                shift = statistics.median(recent) - test.mu
                alarms.append(Alarm(signal.name, direction, shift,
                                    signal.rise if direction > 0 else signal.fall))
        return alarms[0] if alarms else None


def window_shift(reference: Sequence[StepMetrics], window: Sequence[StepMetrics],
                 signals: Sequence[Signal] = SIGNALS) -> Alarm | None:
    """Two windows of the same configuration: the first context signal whose medians differ by more
    than max(min_shift, 3 standard errors) — a change that happened between them."""
    for signal in signals:
        if signal.name == "step_time":
            continue
        a = [v for v in map(signal.extract, reference) if math.isfinite(v)]
        b = [v for v in map(signal.extract, window) if math.isfinite(v)]
        if len(a) < MIN_REFERENCE or len(b) < MIN_REFERENCE:
            continue
        sigma = max(signal.sigma_floor, robust_sigma(a), robust_sigma(b))
        shift = statistics.median(b) - statistics.median(a)
        if abs(shift) > max(signal.min_shift, 3 * 1.253 * sigma * math.sqrt(1 / len(a) + 1 / len(b))):
            return Alarm(signal.name, 1 if shift > 0 else -1, shift, signal.rise if shift > 0 else signal.fall)
    return None


# How far a context signal may differ between two windows of *different* configurations before the
# difference cannot be the configurations' doing: the bandwidth estimate (bytes / communication
# span) moves with the configuration (p99 of 1.4 in log units between configurations of one context
# in the prior's simulated data, p97 below log 3); compute time (forward + backward) moves only by
# contention (p90 0.05, p99 0.44). Above these, the context changed during the search.
JUMP_LIMITS = {"bandwidth": math.log(3.0), "compute": 0.3, "host_load": 0.3}


def context_jump(reference: Sequence[StepMetrics], window: Sequence[StepMetrics]) -> Alarm | None:
    """A change of context between two windows of different configurations (a search's incumbent
    and a trial): a jump larger than any configuration explains."""
    for signal in SIGNALS:
        limit = JUMP_LIMITS.get(signal.name)
        if limit is None:
            continue
        a = [v for v in map(signal.extract, reference) if math.isfinite(v)]
        b = [v for v in map(signal.extract, window) if math.isfinite(v)]
        if len(a) < 3 or len(b) < 3:
            continue
        shift = statistics.median(b) - statistics.median(a)
        if abs(shift) > limit:
            return Alarm(signal.name, 1 if shift > 0 else -1, shift, signal.rise if shift > 0 else signal.fall)
    return None
