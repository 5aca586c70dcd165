"""Drift detection while a configuration is held: a two-sided CUSUM (Page's test) per signal.

Signals, per step of the held configuration (rank 0): log step time (the residual against what the
held configuration measured), log of the scheduler's bandwidth estimate, log compute time (forward
+ backward) and the host load (when the client knows it). Each is compared with a reference window
of the *same* configuration, so a signal that depends on the configuration (the bandwidth estimate
does) is still comparable.

The test runs on block medians of about half a second of steps (DriftDetector). For a signal with
reference median mu and robust spread sigma (1.4826 x MAD of the reference blocks, floored), and a
minimum relevant shift `delta` (a change smaller than that is not worth a re-tune):

    d_t = clip(x_t - mu, -c, c)                 c = k + h/3: three wild blocks cannot alarm alone
    S+_t = max(0, S+_{t-1} + d_t - k)           k = max(delta/2, sigma/2)
    S-_t = max(0, S-_{t-1} - d_t - k)           h = max(2 delta, 10 sigma)
    alarm when S+ > h or S- > h

Why these constants (first principles, not fitted to any scenario): k = delta/2 is the classic
choice for detecting a shift of size delta; h = 10 sigma with k >= sigma/2 gives an in-control
average run length above 10^5 blocks for Gaussian noise (Siegmund's approximation), i.e. well
under one false alarm per hour at two blocks a second; h >= 2 delta means a shift of exactly delta needs about
four blocks to alarm, and the clipping at c needs at least four wild blocks in a row (a rare slow
step, a GC pause, is not a change). The minimum
shifts: step time 10% (below that a re-tune rarely pays for its trials), bandwidth 25% and compute
15% (changes of the communication/computation balance that move the best partition/credit in the
simulator's and the testbed's maps), host load 0.2 (a fifth of the host's cores taken by others).
`python -m benchmarks.bench_tuner drift` measures the false alarms on stationary runs.

Which change it was (the label of a re-tune) is decided from *which* signal moved, by how much in
units of its own minimum relevant shift, never by which CUSUM crossed first (several saturate at
the clipped rate together, so "first" is a coin toss), and on the signals measured where they
are true:
- compute is forward_s + backward_s, which the client measures *without* the waits for
  parameters (those are exposed communication): counted in, a bandwidth drop lengthens the
  forward pass's waits and reads as a "compute slowdown";
- the samples are the job's, merged over its ranks (tuner.ranks): compute is watched *per rank*
  (`job_signals`: one CUSUM on each rank's own compute, each against its own reference and
  noise, named "compute slowdown on rank r"): a CPU quota on rank 1 raises rank 1's compute while
  rank 0's does not move, and the straggler's per-step max would take the swings of the noisiest
  rank (rank 0's 75-220 ms under a neighbour's load hid rank 1's 2.3x), bandwidth the best
  estimate of any rank (a straggler lowers only its peers' estimates; a true bandwidth drop
  lowers every rank's), host load the busiest host's;
- each signal's noise is the larger of the reference blocks' spread and what the steps inside
  them imply for a block's median (sqrt(pi/2) sigma_step / sqrt(steps per block)): eight block
  medians alone estimate a spread to within a factor of two, and on the testbed a rank's compute
  (sigma ~0.15 per block, about its own min_shift) drew references as tight as 0.03 that then
  alarmed on the host's ordinary swings (16 of 30 runs had an alarm before any change);
- a rank's own compute alarms only when the job moved the same way, half way to a threshold:
  its step time, or its own context (the bandwidth estimate down or the host load up beside a
  rank's slowdown; up and down beside a speed-up): watching every
  rank multiplies the tests, and a rank that speeds up or slows down without moving the job's step
  (it is not the one that paces it) changes nothing the tuner could win back; the rank's test
  restarts instead. When the job's context did move (a quota on rank 1 lowers the bandwidth
  estimate too, and that test may cross in the same block or a block later), the rank's alarm
  stays: it names the cause (on the testbed a quota's rank alarm was restarted one block before
  the bandwidth test crossed, with the step's test at 0.48 of its threshold: "bandwidth drop");
- the label is measured on the same fresh blocks for every signal: the last (at most
  FRESH_BLOCKS) since the change point of the test that alarmed (the blocks since its statistic
  was last 0; the shortest of several), so no signal is diluted by its own blocks from before the
  change (a rank's compute that drifted up on noise before a quota would read as half its shift);
- a step-time alarm waits up to LABEL_WAIT_BLOCKS blocks for a context test to cross before it
  is labelled (the context test's own change point then says which blocks are fresh), and without
  one it is labelled on the blocks after the alarm (and a step time whose statistic falls back
  under its threshold while it waits was a blip: no alarm): the step-time test is the noisiest, its
  statistic can sit part way up on noise for many blocks and cross in the first block after a
  change, when the context's tests have seen one block of it (a third of their threshold at most,
  by the clipping) and its own "fresh" blocks are mostly from before the change (on the testbed:
  competing flows labelled "step time rise" or by a rank's compute swing). A context test needs
  at least four blocks to cross, so the wait is four blocks (about 2 s at the steps' pace when the
  block size was chosen, longer when the steps slowed down since); every alarm of the step time
  alone starts that much later;
- among the context signals at least half way to their threshold (`cause_of`): one rank's compute
  moving apart from the other ranks' (by its min_shift and by 2.5 standard errors of the
  difference) is that rank's change, and explains a fall of the bandwidth estimate too (its peers'
  collectives wait for it: a 50% CPU quota on rank 1 raises its compute 2.2x and lowers the best
  bandwidth estimate 40%); of two ranks apart, the one whose own compute moved more; but a rank
  moving against the link (its compute faster while the estimate falls, or slower while it rises)
  is the link's effect, not its cause (`autobyted.signals.rank_explains_link`: the job's traffic takes CPU on this
  host, so a slower link frees it: the quick start's drop to 300 Mbit/s sped rank 0's compute up
  40%). Otherwise the
  signal that moved most in units of its min_shift (a bandwidth drop of 300/2000 moves log
  bandwidth by 7.6 of its min_shift while compute stays), except that compute moving on every rank
  *together* with a bandwidth change of at least its min_shift is the link's: on the testbed's
  shared host two competing flows cost every rank CPU (compute 2x on both ranks, bandwidth
  estimate 3.3x lower), so a job-wide compute rise beside a link change is read as the link.
  Host load names a change only when it moved more than compute and bandwidth did, and not the
  same way as a link change of at least its min_shift (less traffic, less of the host's CPU: the
  quick start's drop lowered it from 0.42 to 0.13-0.25); the
  other ranks of the job on the same host count as "others" in it (autobyte.hostload), so a
  change of the job's own CPU use moves it too.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence

from autobyte.types import StepMetrics

from autobyted.signals import SIGNALS, Signal, cause_of, log_or_nan, robust_sigma

MIN_REFERENCE = 5
FRESH_BLOCKS = 4  # blocks after an alarm's change point that its label is measured on
LABEL_WAIT_BLOCKS = 4  # blocks a step-time alarm waits for a context test to cross (one needs >= 4)
MEDIAN_SE = math.sqrt(math.pi / 2)  # a median of n normal draws: sqrt(pi/2) sigma/sqrt(n) (large n)


def _rank_compute(rank: int) -> Callable[[StepMetrics], float]:
    def extract(m: StepMetrics) -> float:
        for r, seconds in getattr(m, "rank_compute_s", ()):
            if r == rank:
                return log_or_nan(seconds)
        return math.nan

    return extract


def job_signals(
    samples: Sequence[StepMetrics], signals: Sequence[Signal] = SIGNALS
) -> tuple[Signal, ...]:
    """The signals to watch on a job's samples: `signals`, with the job's compute replaced by one
    signal per rank when the samples carry every rank's compute (tuner.ranks.JobStep, 2+ ranks)."""
    ranks = sorted({r for m in samples for r, _ in getattr(m, "rank_compute_s", ())})
    if len(ranks) < 2:
        return tuple(signals)
    out: list[Signal] = []
    for signal in signals:
        if signal.name != "compute" or signal.rank is not None:
            out.append(signal)
            continue
        out += [
            dataclasses.replace(
                signal,
                extract=_rank_compute(r),
                rank=r,
                rise=f"{signal.rise} on rank {r}",
                fall=f"{signal.fall} on rank {r}",
            )
            for r in ranks
        ]
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Alarm:
    signal: str
    direction: int  # +1 up, -1 down
    shift: float  # current estimate of the shift (median of the last steps minus the reference)
    reason: str
    # the latest steps already in the new context: those of the blocks the shift was measured on,
    # but the first (which may straddle the change); a re-tune's baseline starts with them
    fresh_steps: int = 0
    rank: int | None = None  # the rank whose own compute moved; None: the job's signal


class Cusum:
    """Two-sided CUSUM on one signal against a fixed reference (see the module docstring)."""

    def __init__(self, mu: float, sigma: float, min_shift: float) -> None:
        self.mu = mu
        self.sigma = sigma
        self.k = max(min_shift / 2, sigma / 2)
        self.h = max(2 * min_shift, 10 * sigma)
        self.clip = self.k + self.h / 3
        self.up = 0.0
        self.down = 0.0
        # The blocks since each statistic was last 0: the change began after that (the CUSUM's own
        # change-point estimate), so their median is the size of the change, not lagged by blocks
        # from before it.
        self.run_up: list[float] = []
        self.run_down: list[float] = []

    def restart(self) -> None:
        """Back to in control (against the same reference)."""
        self.up = self.down = 0.0
        self.run_up.clear()
        self.run_down.clear()

    def update(self, x: float) -> int:
        """+1 / -1 on an alarm upward / downward, else 0."""
        d = min(self.clip, max(-self.clip, x - self.mu))
        self.up = max(0.0, self.up + d - self.k)
        self.down = max(0.0, self.down - d - self.k)
        for statistic, run in ((self.up, self.run_up), (self.down, self.run_down)):
            if statistic == 0.0:
                run.clear()
            else:
                run.append(x)
                del run[:-64]
        if self.up > self.h:
            return 1
        if self.down > self.h:
            return -1
        return 0


class DriftDetector:
    """CUSUMs of every signal of the held configuration, on block medians.

    Steps are grouped into blocks of about `block_s` seconds (one step per block when steps are
    slower than that) and the CUSUM runs on each block's median: a 5 ms step and a 5 s step then
    give the same false-alarm rate per unit of *time*, a single slow step never counts alone, and
    the noise that matters (over a block) is what the reference measures. The reference is the
    first `reference_blocks` blocks (a head start may be given: the window that measured the held
    configuration); until then nothing alarms.
    """

    def __init__(
        self,
        head_start: Sequence[StepMetrics] = (),
        signals: Sequence[Signal] = SIGNALS,
        block_s: float = 0.5,
        reference_blocks: int = 8,
        shift_scale: float = 1.0,
    ) -> None:
        self._base_signals = tuple(signals)
        self._signals = self._base_signals  # per rank once the reference shows the ranks (_start)
        self._reference_samples: list[list[StepMetrics]] = []
        self._shift_scale = shift_scale  # > 1 after fruitless re-tunes (JobTuner's back-off)
        self._block_s = block_s
        self._reference_blocks = reference_blocks
        self._block_steps = 0  # decided from the first samples' step time
        self._pending: list[StepMetrics] = []
        self._reference: list[dict[str, float]] = []
        self._tests: list[tuple[Signal, Cusum]] | None = None
        self._recent: dict[str, list[float]] = {}
        self._deferred: int | None = None  # blocks since a step-time alarm whose label waits
        self._head_blocks = 0  # reference blocks that came from the head start
        for sample in head_start:
            self.update(sample)
        self._head_blocks = len(self._reference_samples)

    @property
    def ready(self) -> bool:
        return self._tests is not None

    @property
    def watched(self) -> tuple[str, ...]:
        return tuple(signal.key for signal, _ in self._tests or ())

    @property
    def noise(self) -> dict[str, float]:
        """Each watched signal's spread per block, as its test uses it (module docstring)."""
        return {signal.key: test.sigma for signal, test in self._tests or ()}

    def _block_medians(self, block: Sequence[StepMetrics]) -> dict[str, float]:
        out = {}
        for signal in self._signals:
            values = [v for v in map(signal.extract, block) if math.isfinite(v)]
            out[signal.key] = statistics.median(values) if values else math.nan
        return out

    def _moved_in_reference(self) -> Alarm | None:
        """A change while the reference was collected: its later blocks (those after the head
        start, else its second half) against the earlier, by `window_shift`. The CUSUMs cannot see
        it: against a reference whose median is already the new context's (or whose spread the
        two contexts inflate), the blocks after it are in control. A configuration held just
        before a change is exactly that case: the window that measured it is the head start, the
        blocks that complete the reference straddle the change (the quick start's links dropped
        1.4 s after a re-tune returned to the incumbent: 2 blocks before the drop, 6 after, and no
        alarm followed). Only a change the job felt counts, as for the CUSUMs: a rank's compute
        alone, with the step time not moved half its min_shift the same way, is not one."""
        blocks = self._reference_samples
        split = self._head_blocks if 0 < self._head_blocks < len(blocks) else len(blocks) // 2
        earlier = [m for block in blocks[:split] for m in block]
        later = [m for block in blocks[split:] for m in block]
        signals = [
            dataclasses.replace(s, min_shift=s.min_shift * self._shift_scale)
            for s in self._base_signals
        ]
        alarm = window_shift(earlier, later, signals)
        if alarm is None:
            return None
        if alarm.rank is not None:
            step = next(s for s in signals if s.name == "step_time")
            felt = [[v for v in map(step.extract, w) if math.isfinite(v)] for w in (earlier, later)]
            if (
                not all(felt)
                or (statistics.median(felt[1]) - statistics.median(felt[0])) * alarm.direction
                < step.min_shift / 2
            ):
                return None
        # the later blocks' median is the new context's, so their second half is in it
        fresh = min(FRESH_BLOCKS - 1, (len(blocks) - split) // 2)
        return dataclasses.replace(alarm, fresh_steps=fresh * self._block_steps)

    def _start(self) -> None:
        self._tests = []
        steps = [m for block in self._reference_samples for m in block]
        self._signals = job_signals(steps, self._base_signals)
        self._reference = [self._block_medians(block) for block in self._reference_samples]
        self._reference_samples = []
        for signal in self._signals:
            values = [b[signal.key] for b in self._reference if math.isfinite(b[signal.key])]
            if len(values) < max(MIN_REFERENCE, len(self._reference) // 2):
                continue  # not measured (e.g. host load from an older client): not watched
            per_step = [v for v in map(signal.extract, steps) if math.isfinite(v)]
            sigma = max(
                signal.sigma_floor,
                robust_sigma(values),
                MEDIAN_SE * robust_sigma(per_step) / math.sqrt(self._block_steps),
            )
            self._tests.append(
                (
                    signal,
                    Cusum(statistics.median(values), sigma, signal.min_shift * self._shift_scale),
                )
            )
            self._recent[signal.key] = []

    def update(self, sample: StepMetrics) -> Alarm | None:
        """Feed one step; an alarm when a block completes with a signal out of control (the step
        time alone: up to LABEL_WAIT_BLOCKS blocks later), named after the context signal that
        explains it (`cause_of`; so the reason names the cause when it is visible), else the
        step-time residual."""
        if not self._block_steps:
            self._block_steps = max(
                1, min(1000, round(self._block_s / max(sample.step_time_s, 1e-6)))
            )
        self._pending.append(sample)
        if len(self._pending) < self._block_steps:
            return None
        if self._tests is None:
            self._reference_samples.append(self._pending)
            self._pending = []
            if len(self._reference_samples) < self._reference_blocks:
                return None
            moved = self._moved_in_reference()
            self._start()
            return moved
        block = self._block_medians(self._pending)
        self._pending = []
        alarmed: list[tuple[Signal, Cusum]] = []
        for signal, test in self._tests:
            x = block[signal.key]
            if not math.isfinite(x):
                continue
            recent = self._recent[signal.key]
            recent.append(x)
            del recent[:-64]
            if test.update(x):
                alarmed.append((signal, test))

        if self._deferred is not None:
            self._deferred += 1
            if not any(signal.name != "step_time" for signal, _ in alarmed):
                if not alarmed:  # the step time's statistic fell back under its threshold: a blip
                    self._deferred = None
                    return None
                if self._deferred < LABEL_WAIT_BLOCKS:
                    return None
                # no context test crossed: the label is measured on the blocks since the alarm
                since, self._deferred = min(FRESH_BLOCKS, self._deferred), None
                return self._label(since)
            self._deferred = None  # a context test crossed: its own change point says which blocks
        elif not alarmed:
            return None
        elif all(signal.name == "step_time" for signal, _ in alarmed):
            self._deferred = 0  # wait for the context's tests (module docstring: a late label)
            return None
        step = next((test for signal, test in self._tests if signal.name == "step_time"), None)

        def felt(test: Cusum) -> bool:
            """The job moved (half way to an alarm) the way this rank's compute did: its step time,
            or its bandwidth estimate down / host load up beside a slowdown (the other way beside
            a speed-up)."""
            slower = test.up > test.h
            if step is None or (step.up if slower else step.down) >= step.h / 2:
                return True
            for signal, job in self._tests:
                if signal.rank is None and signal.name in ("bandwidth", "host_load"):
                    toward = job.down if (signal.name == "bandwidth") == slower else job.up
                    if toward >= job.h / 2:
                        return True
            return False

        if all(signal.rank is not None and not felt(test) for signal, test in alarmed):
            for _, test in alarmed:  # only ranks' compute moved, the job did not: not a change
                test.restart()  # of the job's context (module docstring)
            return None

        # Every signal's shift is measured over the same, fresh blocks: the last (at most
        # FRESH_BLOCKS) since the change point of the test that alarmed (the shortest such run),
        # so that no signal is diluted by blocks from before the change.
        def run_of(test: Cusum) -> list[float]:
            return test.run_up if test.up / test.h >= test.down / test.h else test.run_down

        return self._label(max(1, min(FRESH_BLOCKS, *(len(run_of(test)) for _, test in alarmed))))

    def _label(self, since: int) -> Alarm:
        """The alarm's reason, from every signal's shift over its last `since` blocks: the cause
        (module docstring, `cause_of`) among the context signals at least half way to their
        threshold; else the step-time residual. Its `fresh_steps`: those blocks' steps but the
        first block's."""
        return dataclasses.replace(
            self._named(since), fresh_steps=max(0, since - 1) * self._block_steps
        )

    def _named(self, since: int) -> Alarm:
        assert self._tests is not None

        def progress(item):
            return max(item[1].up, item[1].down) / item[1].h

        shifts = {}
        for signal, test in self._tests:
            recent = self._recent[signal.key][-since:]
            shifts[signal.key] = (
                signal,
                statistics.median(recent) - test.mu if recent else 0.0,
                MEDIAN_SE * test.sigma / math.sqrt(max(1, len(recent))),
            )
        context = {
            signal.key
            for signal, test in self._tests
            if signal.name != "step_time" and progress((signal, test)) >= 0.5
        }
        cause = cause_of(shifts, context)
        if cause is None:  # no context signal moved: the step-time residual, or the nearest test
            signal, test = max(self._tests, key=progress)
            shift = shifts[signal.key][1]
            direction = (1 if shift > 0 else -1) if shift else (1 if test.up >= test.down else -1)
            return Alarm(
                signal.name,
                direction,
                shift,
                signal.rise if direction > 0 else signal.fall,
                rank=signal.rank,
            )
        return _alarm(*cause)


def window_shift(
    reference: Sequence[StepMetrics],
    window: Sequence[StepMetrics],
    signals: Sequence[Signal] = SIGNALS,
) -> Alarm | None:
    """Two windows of the same configuration: among the context signals whose medians differ by
    more than max(min_shift, 3 standard errors), the one that moved most in units of its min_shift
    (module docstring) — a change that happened between them."""
    shifts, moved = {}, set()
    for signal in job_signals([*reference, *window], signals):
        if signal.name == "step_time":
            continue
        a = [v for v in map(signal.extract, reference) if math.isfinite(v)]
        b = [v for v in map(signal.extract, window) if math.isfinite(v)]
        if len(a) < MIN_REFERENCE or len(b) < MIN_REFERENCE:
            continue
        sigma = max(signal.sigma_floor, robust_sigma(a), robust_sigma(b))
        se = MEDIAN_SE * sigma * math.sqrt(1 / len(a) + 1 / len(b))
        shift = statistics.median(b) - statistics.median(a)
        shifts[signal.key] = (signal, shift, se)
        if abs(shift) > max(signal.min_shift, 3 * se):
            moved.add(signal.key)
    cause = cause_of(shifts, moved)
    return _alarm(*cause) if cause else None


def _alarm(signal: Signal, shift: float) -> Alarm:
    return Alarm(
        signal.name,
        1 if shift > 0 else -1,
        shift,
        signal.rise if shift > 0 else signal.fall,
        rank=signal.rank,
    )


# How far a context signal may differ between two windows of *different* configurations before the
# difference cannot be the configurations' doing: the bandwidth estimate (bytes / communication
# span) moves with the configuration (p99 of 1.4 in log units between configurations of one context
# in the prior's simulated data, p97 below log 3); compute time (forward + backward) moves only by
# contention (p90 0.05, p99 0.44). Above these, the context changed during the search.
JUMP_LIMITS = {"bandwidth": math.log(3.0), "compute": 0.3, "host_load": 0.3}


def context_jump(reference: Sequence[StepMetrics], window: Sequence[StepMetrics]) -> Alarm | None:
    """A change of context between two windows of different configurations (a search's incumbent
    and a trial): a jump larger than any configuration explains (JUMP_LIMITS); of several, the
    cause by the same precedence as every other label (`cause_of`: a rank's compute or the host load
    moving beside a link jump its traffic explains is the link's)."""
    shifts, moved = {}, set()
    for signal in job_signals([*reference, *window]):
        limit = JUMP_LIMITS.get(signal.name)
        if limit is None:
            continue
        a = [v for v in map(signal.extract, reference) if math.isfinite(v)]
        b = [v for v in map(signal.extract, window) if math.isfinite(v)]
        if len(a) < 3 or len(b) < 3:
            continue
        sigma = max(signal.sigma_floor, robust_sigma(a), robust_sigma(b))
        shift = statistics.median(b) - statistics.median(a)
        shifts[signal.key] = (signal, shift, MEDIAN_SE * sigma * math.sqrt(1 / len(a) + 1 / len(b)))
        if abs(shift) > limit:
            moved.add(signal.key)
    cause = cause_of(shifts, moved)
    return _alarm(*cause) if cause else None


def fastest_in_context(reference: Sequence[StepMetrics], window: Sequence[StepMetrics]) -> float:
    """The shortest median step time `reference`'s configuration could reach in the context
    `window` was measured in: a bound from what a step is made of (compute c, forward + backward
    without waits, and the rest t - c, communication the step did not hide) and every context
    signal's move *in the window's favour* (a move against it makes no configuration faster). A
    step is never shorter than its compute, nor than its communication (the link is one queue:
    a step's all-reduces take their time, however the next forward overlaps them), which was at
    least the exposed t - c, nor faster as a whole than its fastest part became. So with compute
    faster by f, a link faster by a factor r (the bandwidth estimate) and others' host load
    falling from L to L' (the job gets at most (1 - L) / (1 - L') times the CPU):

        max(c / f, (t - c) / r, t / max(f, r)) x (1 - L) / (1 - L')

    Not c / f + (t - c) / r: overlap can hide the whole of a faster link's communication (on the
    emulated testbed a rate 4x faster took a step from 2.97 s to 1.64 s, its compute 1.52 s; the
    sum said 2.06 s at best). A configuration measured faster than this in `window` is faster
    whatever the context did (tuner.search: no check). The bandwidth estimate also moves with the
    configuration (small partitions' overheads read as a slow link), which only lowers the bound:
    conservative."""

    def median_of(samples, extract, log=True):
        values = [extract(m) for m in samples]
        values = [math.log(v) if log else v for v in values if v > 0]
        return statistics.median(values) if values else None

    t = statistics.median(m.step_time_s for m in reference)
    compute = min(t, statistics.median(m.forward_s + m.backward_s for m in reference))
    moves = {}
    for name, extract in (
        ("bandwidth", lambda m: m.bandwidth_bytes_per_s),
        ("compute", lambda m: m.forward_s + m.backward_s),
        ("host_load", lambda m: m.host_load),
    ):
        a, b = (
            median_of(reference, extract, name != "host_load"),
            median_of(window, extract, name != "host_load"),
        )
        moves[name] = (a, b) if a is not None and b is not None else None
    r = (
        math.exp(max(0.0, moves["bandwidth"][1] - moves["bandwidth"][0]))
        if moves["bandwidth"]
        else 1.0
    )
    f = math.exp(max(0.0, moves["compute"][0] - moves["compute"][1])) if moves["compute"] else 1.0
    cpu = 1.0
    if moves["host_load"]:
        before, after = moves["host_load"]
        cpu = (1 - min(before, 0.99)) / (1 - min(before, after, 0.99))
    return max(compute / f, (t - compute) / r, t / max(f, r)) * cpu


# The direction in which a context signal's move makes every configuration faster.
FAVOURABLE = {"bandwidth": 1, "compute": -1, "host_load": -1}


def favourable_move(
    reference: Sequence[StepMetrics], window: Sequence[StepMetrics]
) -> Alarm | None:
    """A move of the context between two windows of *different* configurations (a search's
    incumbent and a trial) in the window's favour, beyond the signal's min_shift and 3 standard
    errors (window_shift's test), though smaller than a configuration alone can explain
    (JUMP_LIMITS): a link faster, compute or others' load lighter. None when what moved most moved
    against the window. Whether it matters is the caller's: only where it could explain the
    window's gain (fastest_in_context)."""
    alarm = window_shift(reference, window)
    if alarm is None or FAVOURABLE.get(alarm.signal) != alarm.direction:
        return None
    return alarm
