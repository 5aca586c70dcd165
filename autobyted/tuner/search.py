"""The per-job search: `JobTuner`, fed with a job's step metrics (tuner.ranks) in step order.

It keeps the job's bookkeeping (the newest step, the configuration and decision in effect, the
decision it waits for the job to apply, the steps after a switch it discards) and hands every other
sample to the phase in effect, which returns what it asks for (tuner.actions);
tuner.transitions acts on it and returns the phase the next sample goes to. The phases, one module
each, are tuner.phases (its docstring is the map of the search):

    warm-up -> baseline -> exploring k/N -> (checking) -> (confirming) -> verifying -> holding
                  ^                                                                     |
                  +--------------------- re-tuning <-- drift (drift.py), rescore --------+

and paused (an operator's decision or pause; only a resume ends it). What lasts across phases is
tuner.job (`TunerJob`, `Search`); the arithmetic of the decisions tuner.verdict; the evidence of
earlier jobs and this job's predictor errors tuner.evidence.

Nothing here does I/O: decisions, measured effects, windows and status go to a `TunerSink`
(the daemon's writes to storage and the control path; the benchmark's simulator adapter).
Constants and how they were chosen: `TunerParams` (`tuner.params`); the candidates: `tuner.grid`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autobyte.types import StepMetrics

from autobyted.storage.records import TunerStatusRecord
from autobyted.tuner import transitions
from autobyted.tuner.features import JobShape
from autobyted.tuner.grid import candidate_grid, describe
from autobyted.tuner.job import TunerJob
from autobyted.tuner.params import TunerParams
from autobyted.tuner.phases import Phase
from autobyted.tuner.phases.baseline import WarmUp
from autobyted.tuner.predictor import Predictor, Window
from autobyted.tuner.sink import TunerSink
from autobyted.tuner.verdict import TrialValue, gain_calibration, trial_value

__all__ = [
    "JobTuner",
    "TrialValue",
    "TunerParams",
    "TunerSink",
    "candidate_grid",
    "describe",
    "gain_calibration",
    "trial_value",
]


class JobTuner:
    """The search for one job. Feed it the job's samples (rank 0's, or every rank's merged per step
    by tuner.ranks.merge_ranks) in step order with `observe`."""

    def __init__(
        self,
        job: str,
        shape: JobShape,
        predictor: Predictor,
        sink: TunerSink,
        mode: str = "auto",
        params: TunerParams = TunerParams(),
        known: Sequence[Window] = (),
        first_segment: int = 0,
    ) -> None:
        if mode not in ("auto", "observe"):
            raise ValueError(f"tuner mode {mode!r} is not auto or observe")
        self.job = TunerJob(job, shape, predictor, sink, mode, params, known, first_segment)
        self._phase: Phase = WarmUp(self.job)
        self._transition_steps_left = 0  # steps after a switch that measure the switch itself

    # ------------------------------------------------------------------ public
    def observe(self, samples: Sequence[StepMetrics]) -> None:
        for sample in samples:
            self._on_sample(sample)

    def pause(self, why: str = "an operator decided") -> None:
        if not self.job.paused:
            self._phase = transitions.pause(self.job, why)

    def resume(self) -> None:
        if self.job.paused:
            self._phase = transitions.resume(self.job)

    @property
    def status(self) -> TunerStatusRecord:
        return self.job.status

    @property
    def phase(self) -> str:
        """The phase's name, as status shows it (warm-up, baseline, exploring, ...)."""
        return self.job.phase

    @property
    def detail(self) -> str:
        return self.job.detail

    @property
    def paused(self) -> bool:
        return self.job.paused

    @property
    def mode(self) -> str:
        return self.job.mode

    @property
    def stats(self) -> dict[str, int]:
        """Counters the benchmarks read (never steer anything)."""
        return self.job.stats

    @property
    def own_decision_ids(self) -> set[int]:
        return self.job.own_decision_ids

    # ------------------------------------------------------------------ per sample
    def _on_sample(self, m: StepMetrics) -> None:
        job, params = self.job, self.job.params
        if m.step <= job.newest_step:
            return  # a resent or reordered sample
        if not (m.step_time_s > 0 and math.isfinite(m.step_time_s)):
            return  # not a measurement (the daemon's checks allow 0)
        changed = job.clock.tick(m)
        if m.step < params.warmup_steps or job.paused:
            return
        if job.pending is not None:
            if m.decision_id == job.pending.decision_id:
                job.pending = None
                self._transition_steps_left = params.transition_steps
            elif (
                m.step >= job.pending.apply_at_step + params.apply_timeout_steps
                and m.wall_time_s - job.pending.issued_wall_s > params.apply_timeout_s
            ):
                self._phase = transitions.not_applied(job, job.pending)
                return
            else:
                return  # the job has not switched yet: these steps belong to the previous plan
        elif changed and m.decision_id not in job.own_decision_ids:
            # Someone else's decision took effect (an operator's, or one from before a restart).
            self._phase = transitions.open_search(
                job,
                f"configuration changed to {describe(m.config)} by decision #{m.decision_id}",
                new_segment=True,
                steps=params.baseline_steps,
            )
            self._transition_steps_left = params.transition_steps
        if self._transition_steps_left > 0:
            self._transition_steps_left -= 1
            return
        self._phase = transitions.apply(job, self._phase.on_sample(m), self._phase)
