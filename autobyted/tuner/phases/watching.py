"""Holding, no headroom and observing: watching the held configuration.

drift.DriftDetector watches it; an alarm opens a new context segment and re-tunes (a short
baseline, then the predictor's top candidates for the new context). A drift too gradual for the
detector (a slow ramp) can still make another configuration clearly better: every `rescore_s` the
predictor scores the candidates in the held configuration's current context (`Watching._rescore`).
A decision the job never applied (tuner.transitions' `not_applied`) also ends here, holding what
is in effect.
"""

from __future__ import annotations

import math

from autobyte.types import StepMetrics, describe_speedup

from autobyted.tuner.actions import STAY, Action, Open
from autobyted.tuner.drift import DriftDetector, window_shift
from autobyted.tuner.features import summarize
from autobyted.tuner.grid import describe
from autobyted.tuner.job import TunerJob
from autobyted.tuner.measured import MeasuredWindow
from autobyted.tuner.phases import Phase
from autobyted.tuner.stragglers import LINK_STEPS, where

RECENT_STEPS = 20  # the held configuration's latest steps, the context a rescore predicts from


class Watching(Phase):
    """Watch what `job.held` holds; without a reference yet (a decision the job did not apply, or
    the configuration changed under it) collect one of `reference_steps` steps first."""

    def __init__(self, job: TunerJob, reference_steps: int) -> None:
        super().__init__(job)
        self.reference_steps = reference_steps
        self.detector: DriftDetector | None = None
        self.recent: list[StepMetrics] = []  # the held configuration's latest steps
        self.reference: list[StepMetrics] = []  # the window the held configuration was held on
        self.next_rescore_wall_s = 0.0
        self.window: list[StepMetrics] = []

    def watch(self, held: MeasuredWindow, reference: list[StepMetrics]) -> None:
        job = self.job
        job.held = held
        self.detector = DriftDetector(reference, shift_scale=job.backoff())
        self.recent = list(reference[-RECENT_STEPS:])
        self.reference = list(reference)
        self.next_rescore_wall_s = job.newest_wall_s + job.params.rescore_s

    def on_sample(self, m: StepMetrics) -> Action:
        job, params = self.job, self.job.params
        if job.held is not None and m.config != job.held.config:
            job.held, self.detector, self.window = None, None, []  # not what we hold: start over
        if self.detector is None:
            self.window.append(m)
            if len(self.window) >= self.reference_steps:
                self.watch(
                    MeasuredWindow(m.config, list(self.window), job.decision_in_effect or 0),
                    self.window,
                )
                self.window = []
            return STAY
        alarm = self.detector.update(m)
        if alarm is not None:
            fresh = [*self.recent, m][-alarm.fresh_steps :] if alarm.fresh_steps else []
            link = where(alarm.signal, alarm.direction, fresh or [*self.recent, m][-LINK_STEPS:])
            return Open(
                f"re-tuning after {alarm.reason}{link}",
                new_segment=True,
                steps=params.rebaseline_steps,
                retune=True,
                seed=tuple(fresh),
            )
        self.recent.append(m)
        del self.recent[:-RECENT_STEPS]
        if (
            m.wall_time_s >= self.next_rescore_wall_s
            and len(self.recent) >= params.min_trial_steps + 2
        ):
            self.next_rescore_wall_s = m.wall_time_s + params.rescore_s
            return self._rescore()
        return STAY

    def _rescore(self) -> Action:
        """Every `rescore_s` the predictor (corrected by this job's measured errors) scores the
        candidates in the held configuration's current context, and a candidate predicted clearly
        faster (mean gain above twice min_gain, raised by the fruitless back-off, and its
        optimistic bound past min_gain) re-opens the search."""
        job = self.job
        held = job.held
        assert held is not None
        context = summarize(self.recent, job.shape)
        prediction = job.evidence.corrected(
            job.predictor.predict(context, held.config, job.candidates), held.config
        )
        gate = -math.log1p(job.params.min_gain) * job.backoff()
        best = None
        for candidate, mu, sd in zip(prediction.candidates, prediction.mean, prediction.std):
            if (
                candidate != held.config
                and mu < 2 * gate
                and mu - job.params.kappa * sd < gate
                and (best is None or mu < best[1])
            ):
                best = (candidate, float(mu))
        if best is None:
            return STAY
        # The context the prediction was made in, against the one the configuration was held on:
        # a change the drift detector has not yet confirmed (its blocks take seconds) is named as
        # the cause, as the detector would name it.
        moved = window_shift(self.reference, self.recent)
        return Open(
            f"re-tuning{f' after {moved.reason}' if moved else ''}: {describe(best[0])} "
            f"predicted {describe_speedup(math.exp(-best[1]), describe(held.config))} now",
            new_segment=True,
            steps=job.params.rebaseline_steps,
            retune=True,
        )
