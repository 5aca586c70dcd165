"""Which stored steps of a job ran in the same context: the comparisons `autobyte best` may make.

A configuration's step time is comparable with another's only if both ran under the same
conditions. What the stored steps carry says when those moved:

- a new run of the job (its step numbering starts again);
- the host load (others' CPU share, a property of the host, not of the configuration) moved by
  at least drift.py's minimum relevant shift (0.2);
- the scheduler's bandwidth estimate of a configuration moved against what *the same*
  configuration measured earlier in the context (the estimate depends on the configuration) by a
  factor of 2 or more (BANDWIDTH_SHIFT, log units).

A move counts when CONFIRM_BLOCKS blocks in a row show it with the same cause; blocks are
consecutive steps of one configuration (block medians: one slow step is not a change), BLOCK_STEPS
of them, or fewer (at least MIN_BLOCK_STEPS) where that many take more than BLOCK_SECONDS: a job of
1.7-3.5 s steps under a rate swinging every minute (benchmarks/scenarios/emulated-gpt2-medium-8w-swing.toml)
runs 17 steps in a slow phase, fewer than three blocks of ten, so every phase would stay one
context and `best` would compare what ran at one rate with what ran at the other.
Its cause is the tuner's (`autobyted.signals.cause_of`: the host load that falls with a bandwidth
drop, as less traffic takes less of the host's CPU, is the link's), so `autobyte best` and the
tuner's status name one change alike. The new context begins at the change point: the step from
which the moved signal sits on the far side of half its move (around the first block that showed
it); the step just before it, which the change may have happened in, belongs to neither context. Why 2x and 3 blocks,
not the drift detector's 25% (which watches for a re-tune, with a CUSUM over a known noise level):
on two real 400-step 2-rank gloo jobs on a shared 2-core host, 25% and 2 blocks cut them into 7
and 17 contexts (the estimate of a steady configuration wanders by up to 2x for 10-20 steps there),
2x and 3 blocks into 1 and 6 (a new run and host-load moves of neighbours' processes). The changes
that move the best configuration on the testbed (2 Gbit/s -> 300 Mbit/s: 6.7x) are far beyond it.
A change that falls exactly on a switch to a configuration not yet seen in the context
shows only when a configuration seen before returns (the tuner measures its incumbent again for
that reason); the steps in between count to the earlier context.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import NamedTuple

from autobyte.types import Config

from autobyted.signals import SIGNALS, cause_of

BLOCK_STEPS = 10
# A block closes after BLOCK_SECONDS of steps once it has MIN_BLOCK_STEPS: a job of steps under
# 0.5 s keeps ten-step blocks (the evidence below was measured on such jobs); a job of 1.7 s steps
# confirms a move within 3 blocks of 3 steps (15 s), one of 3.5 s steps within 31 s.
BLOCK_SECONDS = 5.0
MIN_BLOCK_STEPS = 3
CONFIRM_BLOCKS = 3  # blocks in a row that must show a move before it counts (>= 2)
BANDWIDTH_SHIFT = math.log(2.0)
MIN_SHIFT = {**{signal.name: signal.min_shift for signal in SIGNALS}, "bandwidth": BANDWIDTH_SHIFT}
SIGNAL = {signal.name: signal for signal in SIGNALS}


class StepPoint(NamedTuple):
    """One rank-0 step as the segmentation reads it."""

    step: int
    wall_time_s: float
    step_time_s: float
    config: Config
    bandwidth_bytes_per_s: float
    host_load: float


@dataclasses.dataclass(frozen=True)
class Context:
    """A span of a job's steps under the same conditions."""

    index: int  # 1-based, in time order
    run: int  # 1-based
    first_step: int
    last_step: int
    started_by: str  # "the job's start", "a new run", "a bandwidth drop at step 812", ...
    steps: tuple[StepPoint, ...]

    def describe(self, of: int) -> str:
        return (
            f"context {self.index} of {of}: run {self.run}, steps {self.first_step}..{self.last_step}, "
            f"since {self.started_by}"
        )


def _median(values: Sequence[float]) -> float:
    values = [v for v in values if v > 0]
    return statistics.median(values) if values else math.nan


def split_contexts(points: Sequence[StepPoint]) -> list[Context]:
    """The job's steps (rank 0, in wall-time order) cut into contexts (see the module docstring)."""
    contexts: list[Context] = []
    current: list[StepPoint] = []
    started_by = "the job's start"
    run = 1
    load_ref = math.nan
    bandwidth_ref: dict[Config, float] = {}
    # (signal, direction, index in current where the move began, blocks that showed it so far)
    suspect: tuple[str, int, int, int] | None = None
    block: list[StepPoint] = []

    def close(reason: str, at: int, skip: int = 0) -> None:
        """current[:at - skip] ends the context; current[at:] begins the next (skip steps in
        between belong to neither)."""
        nonlocal current, started_by, load_ref, bandwidth_ref, suspect
        if current[: at - skip]:
            part = current[: at - skip]
            contexts.append(
                Context(
                    len(contexts) + 1, run, part[0].step, part[-1].step, started_by, tuple(part)
                )
            )
        current = current[at:]
        started_by, load_ref, bandwidth_ref, suspect = reason, math.nan, {}, None

    def shift_of(point: StepPoint, name: str) -> float:
        """One step's move of a signal from the context's reference (NaN: not measured)."""
        if name == "host_load":
            return point.host_load - load_ref if point.host_load > 0 else math.nan
        reference = bandwidth_ref.get(point.config, math.nan)
        if point.bandwidth_bytes_per_s > 0 and reference > 0:
            return math.log(point.bandwidth_bytes_per_s / reference)
        return math.nan

    def change_point(name: str, direction: int, at: int) -> int:
        """Where in the steps around the first block that showed the move it began: the cut that
        leaves the fewest steps on the wrong side, each step on the side of half the move."""
        half = direction * _median([abs(shift_of(p, name)) for p in current[at:]]) / 2
        lo, hi = max(0, at - BLOCK_STEPS), min(len(current), at + BLOCK_STEPS)
        moved = [
            None
            if math.isnan(x := shift_of(current[i], name))
            else x * direction >= half * direction
            for i in range(lo, hi)
        ]
        best, errors = at, None
        for cut in range(lo, hi + 1):
            wrong = sum(m is True for m in moved[: cut - lo]) + sum(
                m is False for m in moved[cut - lo :]
            )
            if errors is None or wrong < errors:
                best, errors = cut, wrong
        return best

    def judge(block: list[StepPoint]) -> None:
        """Compare a finished block with the context's references; CONFIRM_BLOCKS in a row that
        moved, with the same cause, open a new context."""
        nonlocal load_ref, suspect
        start = len(current) - len(block)
        load = _median([p.host_load for p in block])
        bandwidth = _median([p.bandwidth_bytes_per_s for p in block])
        shifts, moved = {}, set()
        if not math.isnan(load):
            if math.isnan(load_ref):
                load_ref = load
            shifts["host_load"] = (SIGNAL["host_load"], load - load_ref, 0.0)
        if not math.isnan(bandwidth):
            reference = bandwidth_ref.setdefault(block[0].config, bandwidth)
            shifts["bandwidth"] = (SIGNAL["bandwidth"], math.log(bandwidth / reference), 0.0)
        for name, (_signal, shift, _se) in shifts.items():
            if abs(shift) >= MIN_SHIFT[name]:
                moved.add(name)
        # the cause by the tuner's rule (a host load that falls with the link is the link's)
        cause = cause_of(shifts, moved)
        if cause is None:
            suspect = None
            return
        signal, shift = cause
        named = (signal.name, 1 if shift > 0 else -1)
        if suspect is not None and suspect[:2] == named and suspect[3] + 1 < CONFIRM_BLOCKS:
            suspect = (*suspect[:3], suspect[3] + 1)
            return
        if suspect is not None and suspect[:2] == named:
            name, direction, at, _blocks = suspect
            cut = change_point(name, direction, at)
            label = signal.rise if direction > 0 else signal.fall
            # the step before the cut may be the one the change happened in: in neither context
            close(f"a {label} at step {current[cut].step}", cut, skip=1 if cut > 0 else 0)
            # The new context's references come from the blocks that showed the move.
            for p in (current[i : i + BLOCK_STEPS] for i in range(0, len(current), BLOCK_STEPS)):
                load_now = _median([q.host_load for q in p])
                if not math.isnan(load_now) and math.isnan(load_ref):
                    load_ref = load_now
                bandwidth_now = _median([q.bandwidth_bytes_per_s for q in p])
                if not math.isnan(bandwidth_now):
                    bandwidth_ref.setdefault(p[0].config, bandwidth_now)
            return
        suspect = (*named, start, 1)

    previous: StepPoint | None = None
    for point in points:
        if previous is not None and point.step < previous.step:
            if block:
                judge(block)
            block = []
            close("a new run", len(current))
            run += 1
        if block and point.config != block[0].config:
            judge(block)
            block = []
        current.append(point)
        block.append(point)
        if len(block) == BLOCK_STEPS or (
            len(block) >= MIN_BLOCK_STEPS and sum(p.step_time_s for p in block) >= BLOCK_SECONDS
        ):
            judge(block)
            block = []
        previous = point
    close("", len(current))
    return contexts
