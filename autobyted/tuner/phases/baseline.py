"""Warm-up, baseline and re-tuning: the start of every search.

- warm-up: the first `warmup_steps` steps are ignored (allocation, first-use order recording);
  JobTuner skips them, and the first step after them opens the job's first baseline.
- baseline (re-tuning, when a search is re-opened): a window of the configuration in effect (the
  job's starting configuration the first time) gives the context, the noise level and the
  incumbent's step time. tuner.transitions plans the search from it: the predictor scores the whole
  candidate grid (corrected by this job's errors and combined with what earlier jobs measured here:
  tuner.evidence), and the search explores only where a trial pays (tuner.verdict.paying); when
  none pays the job is told at once: "no headroom" (after a re-tune: "no headroom after bandwidth
  drop: ..."), instead of searching to the end.
- observe mode (`autobyted start --tuner observe`): after the baseline, a *recommendation*
  (stored, never pushed) and watching; no trials.
- the warm start: early in the baseline, when an earlier job's winner wins here (`Baseline._warm`);
  else, when an earlier job of this model held another configuration at another rank count, the
  baseline ends there and that configuration is the first trial (`Baseline._carried`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autobyte.types import StepMetrics

from autobyted.tuner.actions import STAY, Action, BaselineMeasured, Open, WarmStart
from autobyted.tuner.job import Search, TunerJob
from autobyted.tuner.measured import MeasuredWindow
from autobyted.tuner.phases import Phase


class WarmUp(Phase):
    """Before the first baseline (JobTuner skips the warm-up steps themselves)."""

    def on_sample(self, m: StepMetrics) -> Action:
        return Open("", new_segment=False, steps=self.job.params.baseline_steps, sample=m)


class Baseline(Phase):
    """The window of the configuration in effect, for the plan of the search."""

    def __init__(self, job: TunerJob, search: Search, seed: Sequence[StepMetrics] = ()) -> None:
        super().__init__(job)
        self.search = search
        # a re-tune after a drift alarm starts with the alarm's steps in the new context (at most
        # half the window: the alarm chose them, the rest are the baseline's own)
        keep = search.window_steps // 2
        self.window: list[StepMetrics] = list(seed)[-keep:] if keep else []
        self._early = len(self.window) > job.params.min_trial_steps + 1  # the early look done

    def on_sample(self, m: StepMetrics) -> Action:
        job, search, params = self.job, self.search, self.job.params
        self.window.append(m)
        if len(self.window) < search.window_steps:
            if (
                not self._early
                and len(self.window) >= params.min_trial_steps + 2
                and job.mode == "auto"
            ):
                self._early = True
                return self._warm(m) or self._carried(m) or STAY
            return STAY
        return BaselineMeasured(
            search, MeasuredWindow(m.config, list(self.window), job.decision_in_effect or 0)
        )

    def _warm(self, m: StepMetrics) -> WarmStart | None:
        """Early in the baseline (min_trial_steps + 2 steps in), when earlier jobs of this shape
        measured this configuration in this context and their search held another one that wins
        here by more than min_gain at z_switch standard errors (tuner.evidence, judged as a warm
        start in exploring is judged): switch to it now, its verification window deciding,
        instead of measuring the rest of the baseline first, so that a second job of a model runs
        what the first one found ~20 steps in. Otherwise None: the baseline runs its full window,
        as for a job nobody measured before."""
        job, params = self.job, self.job.params
        if not job.evidence.known:
            return None
        incumbent = MeasuredWindow(m.config, list(self.window), job.decision_in_effect or 0)
        # The noise as adopting this window would leave it; the job's state is not touched yet.
        candidates, prediction = job.plan(
            incumbent, self.search.trials, job.noise_with(incumbent.samples)[1]
        )
        gate = -math.log1p(params.min_gain)
        confident = [
            (float(mu), c)
            for c, mu, sd in zip(prediction.candidates, prediction.mean, prediction.std)
            if c in job.evidence.known_winners
            and c != incumbent.config
            and mu + params.z_switch * sd < gate
        ]
        if not confident:
            return None
        mu, config = min(confident, key=lambda t: t[0])
        return WarmStart(
            self.search,
            incumbent,
            candidates,
            prediction,
            config,
            incumbent.median_s * math.exp(mu),
        )

    def _carried(self, m: StepMetrics) -> BaselineMeasured | None:
        """Early in the job's first baseline, when no earlier job of this shape was measured (its
        evidence would be the nearer) but one of this model held another configuration at another
        world size (the job restarted at another rank count, tuner.evidence's `carried`): end the
        baseline here and try that configuration first. It is a trial, not a switch: the best
        configuration moves with the rank count (a ring's per-collective cost grows with it), so
        the search judges it as any trial, and goes on."""
        job, search = self.job, self.search
        carried = job.evidence.carried
        first = not (search.retune_reason or job.searched_once or search.trials)
        if carried is None or not first or job.evidence.known or carried.config == m.config:
            return None
        return BaselineMeasured(
            search,
            MeasuredWindow(m.config, list(self.window), job.decision_in_effect or 0),
            carried,
        )
