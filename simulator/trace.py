"""Piecewise-constant time series (link bandwidth, compute slowdown) and the three trace kinds.

A trace is a list of segment start times (the first is 0) and one value per segment; the last
segment lasts forever. Ramps are discretised into `ramp_segments` constant steps, so every trace has
well-defined phases (the oracle's unit) and transfers can be integrated exactly segment by segment.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class PiecewiseConstant:
    """Value `values[i]` holds from `times_s[i]` until `times_s[i + 1]` (the last one forever)."""

    times_s: tuple[float, ...]
    values: tuple[float, ...]
    nonnegative: bool = False  # allow zeros (counts such as competing flows), not only > 0

    def __post_init__(self) -> None:
        if not self.times_s or len(self.times_s) != len(self.values):
            raise ValueError("a trace needs as many segment start times as values, at least one")
        if self.times_s[0] != 0:
            raise ValueError(f"a trace starts at time 0, got {self.times_s[0]}")
        if any(b <= a for a, b in zip(self.times_s, self.times_s[1:])):
            raise ValueError("trace segment start times must increase strictly")
        if any(
            not ((v >= 0 if self.nonnegative else v > 0) and math.isfinite(v)) for v in self.values
        ):
            raise ValueError(
                "trace values must be finite and "
                + ("non-negative" if self.nonnegative else "positive")
            )

    @classmethod
    def constant(cls, value: float, nonnegative: bool = False) -> PiecewiseConstant:
        return cls((0.0,), (float(value),), nonnegative)

    @property
    def is_constant(self) -> bool:
        return len(self.values) == 1

    def segment(self, t: float) -> int:
        return max(0, bisect.bisect_right(self.times_s, t) - 1)

    def at(self, t: float) -> float:
        return self.values[self.segment(t)]

    def next_change(self, t: float) -> float:
        """Start of the first segment after time t (inf when the value never changes again)."""
        index = bisect.bisect_right(self.times_s, t)
        return self.times_s[index] if index < len(self.times_s) else math.inf

    def integrate_until(self, start_s: float, amount: float) -> float:
        """Time at which `amount` (e.g. bytes, at value = bytes/s) is done when starting at start_s."""
        times, values = self.times_s, self.values
        index = max(0, bisect.bisect_right(times, start_s) - 1)
        t, remaining, last = start_s, amount, len(times) - 1
        while True:
            rate = values[index]
            if index == last:
                return t + remaining / rate
            capacity = (times[index + 1] - t) * rate
            if capacity >= remaining:
                return t + remaining / rate
            remaining -= capacity
            t = times[index + 1]
            index += 1

    def phases(self, until_s: float = math.inf) -> list[tuple[float, float, float]]:
        """(start, end, value) for every segment starting before until_s, equal neighbours merged."""
        out: list[tuple[float, float, float]] = []
        for index, start in enumerate(self.times_s):
            if start >= until_s:
                break
            end = self.times_s[index + 1] if index + 1 < len(self.times_s) else math.inf
            end = min(end, until_s)
            value = self.values[index]
            if out and out[-1][2] == value:
                out[-1] = (out[-1][0], end, value)
            else:
                out.append((start, end, value))
        return out

    def scaled(self, factor: float) -> PiecewiseConstant:
        return PiecewiseConstant(
            self.times_s, tuple(v * factor for v in self.values), self.nonnegative
        )

    def combine(
        self, other: PiecewiseConstant, op: Any, nonnegative: bool = False
    ) -> PiecewiseConstant:
        """A trace whose value at t is op(self.at(t), other.at(t)) (equal neighbours merged)."""
        times = sorted(set(self.times_s) | set(other.times_s))
        values: list[float] = []
        kept: list[float] = []
        for t in times:
            value = float(op(self.at(t), other.at(t)))
            if values and values[-1] == value:
                continue
            kept.append(t)
            values.append(value)
        return PiecewiseConstant(tuple(kept), tuple(values), nonnegative)


def step_trace(
    levels: Sequence[float], change_times_s: Sequence[float], nonnegative: bool = False
) -> PiecewiseConstant:
    """levels[0] from 0, levels[i] from change_times_s[i - 1]."""
    if len(levels) != len(change_times_s) + 1:
        raise ValueError("a step trace needs one more level than change times")
    return PiecewiseConstant(
        (0.0, *map(float, change_times_s)), tuple(map(float, levels)), nonnegative
    )


def ramp_trace(
    start_value: float,
    end_value: float,
    ramp_start_s: float,
    ramp_end_s: float,
    ramp_segments: int = 20,
    nonnegative: bool = False,
) -> PiecewiseConstant:
    """start_value until ramp_start_s, then linear to end_value at ramp_end_s, then flat."""
    if ramp_end_s <= ramp_start_s or ramp_segments < 1:
        raise ValueError("a ramp needs ramp_end_s > ramp_start_s and at least one segment")
    times, values = [0.0], [float(start_value)]
    width = (ramp_end_s - ramp_start_s) / ramp_segments
    for index in range(ramp_segments):
        # each segment holds the value at its midpoint; the final level starts at ramp_end_s
        fraction = (index + 0.5) / ramp_segments
        t = ramp_start_s + index * width
        if t == 0.0:
            values[0] = start_value + (end_value - start_value) * fraction
            continue
        times.append(t)
        values.append(start_value + (end_value - start_value) * fraction)
    times.append(float(ramp_end_s))
    values.append(float(end_value))
    return PiecewiseConstant(tuple(times), tuple(values), nonnegative)


def periodic_trace(
    high: float,
    low: float,
    period_s: float,
    low_s: float,
    offset_s: float,
    until_s: float,
    nonnegative: bool = False,
) -> PiecewiseConstant:
    """Periodic congestion: `high`, dropping to `low` for `low_s` every `period_s` from offset_s."""
    if not (0 < low_s < period_s):
        raise ValueError("periodic congestion needs 0 < low_s < period_s")
    times, values = [0.0], [float(high)]
    t = float(offset_s)
    while t < until_s:
        if t == 0.0:
            values[0] = float(low)
        else:
            times.append(t)
            values.append(float(low))
        times.append(t + low_s)
        values.append(float(high))
        t += period_s
    return PiecewiseConstant(tuple(times), tuple(values), nonnegative)


def trace_from_spec(
    spec: dict[str, Any], until_s: float, unit_scale: float = 1.0, nonnegative: bool = False
) -> PiecewiseConstant:
    """Build a trace from a scenario table (docs/benchmarks.md, "Scenario format", has the keys per kind).

    `unit_scale` converts the spec's unit into the trace's (e.g. Mbit/s -> bytes/s);
    `nonnegative` allows zero values (counts, such as competing flows).
    """
    kind = spec.get("kind", "constant")
    s = unit_scale
    if kind == "constant":
        return PiecewiseConstant.constant(float(spec["value"]) * s, nonnegative)
    if kind == "step":
        return step_trace([float(v) * s for v in spec["levels"]], spec.get("at_s", []), nonnegative)
    if kind == "ramp":
        return ramp_trace(
            float(spec["from"]) * s,
            float(spec["to"]) * s,
            float(spec["start_s"]),
            float(spec["end_s"]),
            int(spec.get("segments", 20)),
            nonnegative,
        )
    if kind == "periodic":
        return periodic_trace(
            float(spec["high"]) * s,
            float(spec["low"]) * s,
            float(spec["period_s"]),
            float(spec["low_s"]),
            float(spec.get("offset_s", 0.0)),
            until_s,
            nonnegative,
        )
    raise ValueError(f"unknown trace kind {kind!r}: use constant, step, ramp or periodic")
