"""The tuner of an FSDP2 job (autobyte.fsdp): a measured local search over FSDP2's knobs.

What it searches: `forward_prefetch` (0-3 groups; 0 is FSDP2's implicit prefetch),
`backward_prefetch` (1-3) and `reshard_after_forward` (on or off for every group below the root),
24 points in all. A field the job has never been given stands for the user's own setting (None):
from there its neighbours are the first concrete step away from FSDP2's defaults (forward 1,
backward 2, keep the gathered parameters after forward).

Measured, ordered by a model: the predictor's features describe the scheduler's partitions and
credit window (tuner/__init__.py), not all-gathers, and it has never seen a sharded job. The
job's model of its own schedule does (autobyted/tuner/shard_schedule.py: each group's all-gather
and reduce-scatter on the link, the thread waiting where FSDP2 waits; 2-11% median error on the
testbed, docs/results.md). Where the registration names the job's groups (autobyte.fsdp's
ShardLayout), each round calibrates it on the incumbent's window (its compute: the step less the
time in collectives; the rate at which the schedule takes that step), tries the neighbours
fastest predicted first, leaves out those predicted slower by more than a trial is cut for
(params.clearly_worse), and first of all tries the setting predicted fastest of all 24 where it
is predicted faster than the incumbent by the switch margin (a jump: when it wins, the round
ends there, as with `known`). Every switch is still measured, the way a person tuning FSDP2 by
hand measures, with the tuner's paired arithmetic (tuner.verdict):

    warm-up -> baseline -> exploring k/N -> checking -> verifying -> exploring (next round) ...
                  ^                              |                                    |
                  |                              +-- nothing beat the incumbent --> no headroom
                  +--- re-tuning <-- the held configuration's step time moved --- holding <-+

- a round tries the incumbent's untried neighbours (one knob one step: deeper prefetch and
  keeping the gathered parameters first, since a job whose steps wait on all-gathers lacks
  overlap), at most `max_trials` of them, each for a trial window (`trial_steps`, cut early by the
  sequential test when clearly worse than the incumbent);
- then the incumbent again (checking): a trial wins only when it beats the incumbent measured
  both before and after the round by the switch margin (verdict.beats_both), so a context that
  moved during the round cannot make a trial look better;
- the winner is switched to and measured (verifying); the next round starts from it, at most
  MAX_ROUNDS rounds a search;
- a second job of a model (the same fingerprint and backend; its world size preferred) measures
  what the latest such job held first (`known`, from the manager); when it beats the incumbent by the switch margin
  the round ends there (the check, the switch, then its neighbours' round);
- the held configuration is watched: a window whose median moved beyond the switch margin
  (verdict.step_time_move, the bar raised after fruitless re-tunes as the scheduler's tuner does)
  opens a new search from the configuration in effect.

Memory: the job knows its budget and predicts each configuration's gathered bytes
(autobyte.fsdp.ShardedJob.gathered_bytes). Its registration names every configuration predicted
over the budget (autobyte.records.MemoryLimits, stored on the job): the search never tries one,
and says how many neighbours it left out. Should a decision still be over it (a registration
that named no budget, or an order the ranks learned after registering), the ranks refuse it and it
never runs; the search sees a decision not applied within the apply timeout, marks the candidate
refused for the rest of the job and goes on with the next one.

Nothing here does I/O: decisions and status go to the `TunerSink`, as JobTuner's do.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Sequence

from autobyte.records import MemoryLimits
from autobyte.types import Config, StepMetrics, describe_speedup, speedup

from autobyted.storage.records import TunerStatusRecord
from autobyted.tuner.job import Clock, Noise
from autobyted.tuner.measured import MeasuredWindow, PendingDecision
from autobyted.tuner.params import TunerParams
from autobyted.tuner.shard_schedule import JobSchedule
from autobyted.tuner.sink import TunerSink
from autobyted.tuner.stragglers import LINK_STEPS, name_link
from autobyted.tuner.verdict import beats_both, clearly_worse, step_time_move

log = logging.getLogger(__name__)

FORWARD_DEPTHS = range(4)  # 0: FSDP2's implicit prefetch
BACKWARD_DEPTHS = range(1, 4)
MAX_ROUNDS = 3  # a search walks at most this far from where it started; a re-tune walks on
# Every setting the search can reach, the lightest (least memory) first: a tie of predictions
# goes to it
SPACE = tuple(
    Config(forward_prefetch=f, backward_prefetch=b, reshard_after_forward=r)
    for r in (True, False)
    for f in FORWARD_DEPTHS
    for b in BACKWARD_DEPTHS
)


def neighbours(config: Config) -> list[Config]:
    """The configurations one knob one step from `config`, in the order a round tries them."""
    f, b, r = config.forward_prefetch, config.backward_prefetch, config.reshard_after_forward
    out = []
    if f is None or f + 1 in FORWARD_DEPTHS:
        out.append(dataclasses.replace(config, forward_prefetch=1 if f is None else f + 1))
    if b is None or b + 1 in BACKWARD_DEPTHS:
        out.append(dataclasses.replace(config, backward_prefetch=2 if b is None else b + 1))
    if r is not False:
        out.append(dataclasses.replace(config, reshard_after_forward=False))
    if f is not None and f - 1 in FORWARD_DEPTHS:
        out.append(dataclasses.replace(config, forward_prefetch=f - 1))
    if b is not None and b - 1 in BACKWARD_DEPTHS:
        out.append(dataclasses.replace(config, backward_prefetch=b - 1))
    if r is False:
        out.append(dataclasses.replace(config, reshard_after_forward=True))
    return out


def _short(config: Config) -> str:
    return config.short("fsdp2")


class ShardTuner:
    """One FSDP2 job's search; the manager feeds it the job's samples in step order (`observe`),
    as it does a JobTuner, and reads the same properties."""

    def __init__(
        self,
        job: str,
        sink: TunerSink,
        mode: str = "auto",
        params: TunerParams = TunerParams(),
        memory: MemoryLimits | None = None,
        known: tuple[Config, str] | None = None,
        schedule: JobSchedule | None = None,
    ) -> None:
        if mode not in ("auto", "observe"):
            raise ValueError(f"tuner mode {mode!r} is not auto or observe")
        self.job, self.sink, self.mode, self.params = job, sink, mode, params
        self.memory = memory  # the job's budget: configurations over it are never tried
        self.clock = Clock()
        self.noise = Noise(params.sigma_floor)
        self.own_decision_ids: set[int] = set()
        self.stats = {"trials": 0, "switches": 0, "not_applied": 0, "searches": 0}
        self.paused = False
        self.phase, self.detail = "warm-up", "warm-up: the first steps are not measured"
        self.starting: MeasuredWindow | None = None  # the job's first baseline
        self.incumbent: MeasuredWindow | None = None  # the configuration in effect, measured
        self.refused: set[Config] = set()  # decisions the job never applied (over its budget)
        self._pending: PendingDecision | None = None
        self._pending_kind = ""
        self._skip = 0  # steps after a switch that still measure the switch
        self._window: list[StepMetrics] = []
        self._want = 0
        self._decision = 0  # the decision whose steps the window measures
        self._tried: set[Config] = set()  # measured in this search
        self._queue: list[Config] = []
        self._trials: list[MeasuredWindow] = []  # this round's
        self._round = 0
        self._over_budget = 0  # the round's neighbours left out for the memory budget
        self._switched = False  # this search moved the configuration
        self._fruitless = 0  # searches in a row that kept the configuration
        self._reason = ""
        # What an earlier job of this model held (its configuration, the job): the first round
        # measures it first (`_round_from`), once
        self._known = known
        self._known_from = known[1] if known else ""
        self._known_trial: Config | None = None
        # The job's model of its schedule (its registration's groups), calibrated on each round's
        # incumbent: the round's order, the neighbours it leaves out, the setting it jumps to
        self.schedule = schedule
        self._predicted: dict[Config, float] = {}
        self._jump_trial: Config | None = None
        self._pruned = 0  # the round's neighbours predicted clearly slower, not tried
        if mode == "observe":
            self._set(
                "observing",
                "observe: FSDP2's knobs are searched by measuring them; observe mode tries "
                "nothing (`autobyte propose` sets them)",
            )

    # ------------------------------------------------------------------ the manager's interface
    def observe(self, samples: Sequence[StepMetrics]) -> None:
        for sample in samples:
            self._on_sample(sample)

    def pause(self, why: str = "an operator decided") -> None:
        if not self.paused:
            self.paused = True
            self._pending = None
            self._set("paused", f"paused: {why}")

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self._open("resumed")

    @property
    def status(self) -> TunerStatusRecord:
        held = self.incumbent
        return TunerStatusRecord(
            mode=self.mode,
            state=self.phase,
            detail=self.detail,
            config=held.config if held else (self.clock.config or Config()),
            baseline_step_time_s=self.starting.median_s if self.starting else 0.0,
            measured_step_time_s=held.median_s if held else 0.0,
            trials_done=self.stats["trials"],
            trials_planned=self.stats["trials"] + len(self._queue),
            paused=self.paused,
        )

    # ------------------------------------------------------------------ per sample
    def _on_sample(self, m: StepMetrics) -> None:
        params = self.params
        if m.step <= self.clock.newest_step:
            return  # a resent or reordered sample
        if not (m.step_time_s > 0 and math.isfinite(m.step_time_s)):
            return
        changed = self.clock.tick(m)
        if self.mode == "observe" or self.paused or m.step < params.warmup_steps:
            return
        if self._pending is not None:
            if m.decision_id == self._pending.decision_id:
                self._decision = self._pending.decision_id
                self._pending = None
                self._skip = params.transition_steps
            elif (
                m.step >= self._pending.apply_at_step + params.apply_timeout_steps
                and m.wall_time_s - self._pending.issued_wall_s > params.apply_timeout_s
            ):
                self._not_applied()
                return
            else:
                return  # the job has not switched yet
        elif changed and m.decision_id not in self.own_decision_ids:
            self._open(f"configuration changed to {_short(m.config)} by decision #{m.decision_id}")
            self._decision = m.decision_id
            self._skip = params.transition_steps
        elif self.phase == "warm-up":
            self._open("")
        if self._skip > 0:
            self._skip -= 1
            return
        self._window.append(m)
        if self.phase == "exploring":
            self._on_trial_step()
        elif len(self._window) >= self._want:
            samples, self._window = self._window, []
            measured = MeasuredWindow(samples[-1].config, samples, self._decision)
            self.noise.learn(samples)
            if self.phase in ("baseline", "re-tuning"):
                self._measured_baseline(measured)
            elif self.phase == "checking":
                self._checked(measured)
            elif self.phase == "verifying":
                self._verified(measured)
            else:  # holding, no headroom
                self._watched(measured)

    # ------------------------------------------------------------------ the search
    def _steps(self, nominal: int, seconds: float) -> int:
        step_s = self.clock.step_s
        if step_s <= 0:
            return nominal
        return max(self.params.min_trial_steps + 2, min(nominal, math.ceil(seconds / step_s)))

    def _open(self, reason: str) -> None:
        """A new search, from a fresh measurement of the configuration in effect."""
        self._reason = reason
        self._tried, self._queue, self._trials = set(), [], []
        self._round, self._switched = 0, False
        self._window = []
        self.stats["searches"] += 1
        first = self.starting is None
        self._want = self._steps(
            self.params.baseline_steps if first else self.params.rebaseline_steps,
            self.params.baseline_window_s,
        )
        name = "baseline" if first else "re-tuning"
        note = f" ({reason})" if reason else ""
        self._set(name, f"{name}: measuring {_short(self.clock.config or Config())}{note}")

    def _measured_baseline(self, measured: MeasuredWindow) -> None:
        if self.starting is None:
            self.starting = measured
        self.incumbent = measured
        self._round_from(measured)

    def _round_from(self, incumbent: MeasuredWindow) -> None:
        self._tried.add(incumbent.config)
        self._round += 1
        self._trials = []
        untried = [c for c in neighbours(incumbent.config) if c not in self._tried]
        allowed = [c for c in untried if self._allows(c)]
        self._over_budget = len(untried) - len(allowed)
        queue = [c for c in allowed if c not in self.refused]
        self._predicted, self._pruned, self._jump_trial = self._predict(incumbent), 0, None
        if self._predicted:
            queue, self._jump_trial = self._by_prediction(incumbent, queue)
        self._queue = queue[: self.params.max_trials]
        known, self._known = self._known, None
        if known is not None and (
            known[0] not in self._tried
            and known[0] not in self.refused
            and (self.memory is None or self.memory.allows(known[0]))
        ):
            self._known_trial = known[0]
            self._queue = [known[0], *(c for c in self._queue if c != known[0])]
        if not self._queue or self._round > MAX_ROUNDS:
            self._queue = []
            self._hold(incumbent)
            return
        self._next_trial()

    def _allows(self, config: Config) -> bool:
        return self.memory is None or self.memory.allows(config)

    def _predict(self, incumbent: MeasuredWindow) -> dict[Config, float]:
        """Every reachable setting's step as the job's model predicts it, calibrated on the
        incumbent's window (autobyted/tuner/shard_schedule.py); {} without a model."""
        if self.schedule is None:
            return {}
        exposed = statistics.median(s.exposed_comm_s for s in incumbent.samples)
        calibrated = self.schedule.calibrate(incumbent.config, incumbent.median_s, exposed)
        if calibrated is None:
            return {}
        configs = dict.fromkeys((incumbent.config, *neighbours(incumbent.config), *SPACE))
        return {c: calibrated.predict(c) for c in configs}

    def _by_prediction(
        self, incumbent: MeasuredWindow, queue: list[Config]
    ) -> tuple[list[Config], Config | None]:
        """The round's neighbours fastest predicted first, those predicted slower than the
        incumbent by more than a trial is cut for (params.clearly_worse: the sequential test would
        stop it as clearly worse) left out; first of all the setting predicted fastest of all,
        where it is predicted faster than the incumbent by the switch margin (the jump)."""
        predicted = self._predicted
        own = predicted[incumbent.config]
        kept = [c for c in queue if predicted[c] <= own * (1 + self.params.clearly_worse)]
        self._pruned = len(queue) - len(kept)
        # fastest predicted first; predictions closer than the switch margin keep the neighbours'
        # own order (the model's differences below it are not worth a reordering)
        kept.sort(key=lambda c: round((predicted[c] / own - 1) / self.params.min_gain))
        reachable = [
            c for c in SPACE if c not in self._tried and c not in self.refused and self._allows(c)
        ]
        if not reachable:
            return kept, None
        fastest = min(predicted[c] for c in reachable)
        # the lightest of those within a hair of the fastest (a tie of a saturated link)
        jump = next(c for c in reachable if predicted[c] <= fastest * (1 + 1e-3))
        if own < predicted[jump] * (1 + self.params.min_gain):
            return kept, None
        return [jump, *(c for c in kept if c != jump)], jump

    def _next_trial(self) -> None:
        if not self._queue:
            self._check()
            return
        config = self._queue[0]
        incumbent = self.incumbent
        assert incumbent is not None
        how = f"one knob from {_short(incumbent.config)}"
        if config == self._known_trial:
            how = f"what job {self._known_from} of this model held"
        elif config == self._jump_trial:
            how = f"the fastest of {len(SPACE)} settings as the job's schedule model predicts"
        predicted = self._predicted.get(config)
        basis = "measured, not predicted"
        if predicted is not None:
            basis = (
                f"predicted {predicted * 1e3:.0f} ms against "
                f"{self._predicted[incumbent.config] * 1e3:.0f} ms by the job's schedule model, "
                "measured"
            )
        if not self._issue(
            config,
            "trial",
            f"trial: {_short(config)}, {how} (round {self._round}, {basis}{self._budget_note()})",
            predicted,
        ):
            return
        self._want = self._steps(self.params.trial_steps, self.params.trial_window_s)
        done = len(self._trials) + 1
        self._set(
            "exploring",
            f"exploring {done}/{done + len(self._queue) - 1}: {_short(config)} against "
            f"{_short(incumbent.config)} ({incumbent.median_s * 1e3:.1f} ms)",
        )

    def _on_trial_step(self) -> None:
        params, incumbent = self.params, self.incumbent
        assert incumbent is not None
        n = len(self._window)
        cut = params.min_trial_steps <= n < self._want and clearly_worse(
            (s.step_time_s for s in self._window),
            incumbent.log_median,
            self.noise.sigma,
            params,
        )
        if not cut and n < self._want:
            return
        samples, self._window = self._window, []
        config = self._queue.pop(0)
        trial = MeasuredWindow(config, samples, self._decision, cut=cut)
        self.noise.learn(samples)
        self._tried.add(config)
        self._trials.append(trial)
        self.stats["trials"] += 1
        self.sink.close_decision(self._decision, trial.median_s, "rolled_back" if cut else None)
        if config in (self._known_trial, self._jump_trial):
            if config == self._known_trial:
                self._known_trial = None
            else:
                self._jump_trial = None
            if not cut and beats_both(
                trial.log_median,
                len(trial.samples),
                incumbent.log_median,
                incumbent.log_median,
                len(incumbent.samples),
                self.noise.sigma,
                self.params,
            ):
                # what the earlier job held (or the model's fastest) wins: the check and the
                # rounds from it follow at once (its neighbours are the next round's), not this
                # round's others
                self._queue = []
        self._next_trial()

    def _check(self) -> None:
        incumbent = self.incumbent
        assert incumbent is not None
        if not self._issue(
            incumbent.config,
            "return",
            f"return to {_short(incumbent.config)}: measured again after round {self._round}",
        ):
            return
        self._want = self._steps(self.params.rebaseline_steps, self.params.baseline_window_s)
        self._set(
            "checking",
            f"checking: {_short(incumbent.config)} again after {len(self._trials)} trial(s)",
        )

    def _checked(self, again: MeasuredWindow) -> None:
        before = self.incumbent
        assert before is not None
        self.sink.close_decision(again.decision_id, again.median_s, None)
        n_incumbent = min(len(before.samples), len(again.samples))
        winners = [
            t
            for t in self._trials
            if not t.cut
            and beats_both(
                t.log_median,
                len(t.samples),
                before.log_median,
                again.log_median,
                n_incumbent,
                self.noise.sigma,
                self.params,
            )
        ]
        self.incumbent = again
        if not winners:
            self._hold(again)
            return
        best = min(winners, key=lambda t: t.log_median)
        gain = speedup(max(before.median_s, again.median_s), best.median_s)
        if not self._issue(
            best.config,
            "switch",
            f"switch to {_short(best.config)}: measured "
            f"{describe_speedup(gain, _short(again.config))} (before and after its round)",
            best.median_s,
        ):
            return
        self.stats["switches"] += 1
        self._switched = True
        self._want = self._steps(self.params.rebaseline_steps, self.params.baseline_window_s)
        self._set("verifying", f"verifying {_short(best.config)} after the switch")

    def _verified(self, measured: MeasuredWindow) -> None:
        self.sink.close_decision(measured.decision_id, measured.median_s, None)
        self.incumbent = measured
        self._round_from(measured)

    def _hold(self, measured: MeasuredWindow, why: str = "") -> None:
        self.incumbent = measured
        self._fruitless = 0 if self._switched else self._fruitless + 1
        self._want = self._steps(self.params.rebaseline_steps, self.params.baseline_window_s)
        self._window = []
        start = self.starting
        than = ""
        if start is not None and self._switched:
            gain = speedup(start.median_s, measured.median_s)
            than = f", {describe_speedup(gain, _short(start.config))} as the job started"
        if why:
            self._set("holding", f"holding {_short(measured.config)}: {why}")
        elif self._switched:
            self._set(
                "holding",
                f"holding {_short(measured.config)} ({measured.median_s * 1e3:.1f} ms{than})",
            )
        else:
            tried = len(self._tried) - 1
            self._set(
                "no headroom",
                f"no headroom: {tried} neighbour(s) of {_short(measured.config)} measured, "
                f"none faster beyond the switch margin{self._reason_note()}{self._budget_note()}"
                f"{self._pruned_note()}",
            )

    def _watched(self, measured: MeasuredWindow) -> None:
        held = self.incumbent
        assert held is not None
        bar = self.params.fruitless_backoff ** min(self._fruitless, self.params.fruitless_max)
        params = dataclasses.replace(self.params, min_gain=self.params.min_gain * bar)
        move = step_time_move(
            held.log_median,
            len(held.samples),
            measured.log_median,
            len(measured.samples),
            self.noise.sigma,
            params,
        )
        if move is None:
            return
        reason = f"step time moved {math.expm1(move):+.0%} under {_short(measured.config)}"
        named = name_link(measured.samples[-LINK_STEPS:]) if move > 0 else ""
        if named:  # a slower step with one link queued: where (autobyted/tuner/stragglers.py)
            reason += f": {named}"
        self._open(reason)
        self.incumbent = measured
        self._round_from(measured)

    def _budget_note(self) -> str:
        if not self._over_budget or self.memory is None:
            return ""
        n = self._over_budget
        return (
            f"; {n} neighbour{'s' if n > 1 else ''} over the memory budget of "
            f"{self.memory.budget_bytes:,} bytes not tried"
        )

    def _pruned_note(self) -> str:
        if not self._pruned:
            return ""
        n = self._pruned
        return (
            f"; {n} neighbour{'s' if n > 1 else ''} predicted over "
            f"{self.params.clearly_worse:.0%} slower not tried"
        )

    def _reason_note(self) -> str:
        return f" ({self._reason})" if self._reason else ""

    # ------------------------------------------------------------------ decisions
    def _issue(
        self, config: Config, kind: str, reason: str, predicted_s: float | None = None
    ) -> bool:
        """Ask the job for `config`; False (and the search paused) when the daemon refused it: an
        operator paused the tuner meanwhile."""
        at = self.clock.newest_step + self.params.apply_lead_steps
        decision = self.sink.decide(config, at, reason, predicted_s, kind)
        if decision is None:
            self.pause("an operator paused the tuner")
            return False
        self.own_decision_ids.add(decision)
        self._pending = PendingDecision(decision, config, at, self.clock.newest_wall_s)
        self._pending_kind = kind
        self._window = []
        return True

    def _not_applied(self) -> None:
        pending, kind = self._pending, self._pending_kind
        assert pending is not None
        self._pending = None
        self.stats["not_applied"] += 1
        self.refused.add(pending.config)
        log.warning(
            "job %s did not apply decision #%d (%s) within %.0f s: its ranks refused it (over "
            "their memory budget) or ignore the daemon",
            self.job,
            pending.decision_id,
            _short(pending.config),
            self.params.apply_timeout_s,
        )
        if kind == "trial":  # the job still runs the incumbent: the round goes on
            self._queue.pop(0)
            self._next_trial()
            return
        incumbent = self.incumbent
        assert incumbent is not None
        self._switched = False
        self._hold(
            incumbent,
            f"decision #{pending.decision_id} was not applied by the job within "
            f"{self.params.apply_timeout_s:.0f} s",
        )

    def _set(self, phase: str, detail: str) -> None:
        if (phase, detail) != (self.phase, self.detail):
            self.phase, self.detail = phase, detail
            self.sink.publish(self.status)
