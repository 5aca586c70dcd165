"""Warm-up, baseline and re-tuning: the start of every search.

- warm-up: the first `warmup_steps` steps are ignored (allocation, first-use order recording);
  JobTuner skips them, and the first step after them opens the job's first baseline.
- baseline (re-tuning, when a search is re-opened): a window of the configuration in effect (the
  job's starting configuration the first time) gives the context, the noise level and the
  incumbent's step time. The predictor scores the whole candidate grid from it (corrected by this
  job's errors and combined with what earlier jobs measured here: tuner.evidence), and the search
  explores only where a trial pays (tuner.phases.exploring.paying); when none pays the job is told
  at once: "no headroom" (after a re-tune: "no headroom after bandwidth drop: ..."), instead of
  searching to the end.
- observe mode (`autobyted start --tuner observe`): after the baseline, a *recommendation*
  (stored, never pushed) and watching; no trials.
- abort: the context moved while a search ran: search again in the new context; when that keeps
  happening (`max_aborts` in a row), hold what is in effect and let the drift detector, with a
  raised bar, decide when to look again.
"""

from __future__ import annotations

import math

from autobyte.types import Config, StepMetrics, describe_speedup

from autobyted.tuner.drift import JUMP_LIMITS, Alarm
from autobyted.tuner.features import summarize
from autobyted.tuner.grid import candidate_grid, describe
from autobyted.tuner.job import Search, TunerJob
from autobyted.tuner.measured import MeasuredWindow
from autobyted.tuner.phases import Phase, exploring, verifying, watching
from autobyted.tuner.predictor import Prediction


class WarmUp(Phase):
    """Before the first baseline (JobTuner skips the warm-up steps themselves)."""

    def on_sample(self, m: StepMetrics) -> Phase:
        return start(
            self.job, "", new_segment=False, steps=self.job.params.baseline_steps
        ).on_sample(m)


def start(job: TunerJob, reason: str, new_segment: bool, steps: int) -> Baseline:
    """Open a search: a new context segment (unless it is the job's first), a baseline of `steps`
    (fewer for long steps), and nothing held until the search settles."""
    if new_segment:
        job.segment += 1
    job.search = Search(reason, job.window(steps, job.params.baseline_window_s))
    job.held = None  # what is measured from now on is the new context's incumbent
    phase = "re-tuning" if reason else "baseline"
    prefix = f"{reason}: " if reason else ""
    # Before the job's next step the tuner may not know what is in effect (a tuner opened on a
    # running job reads from its newest step): say so rather than print none/inf.
    in_effect = describe(job.config) if job.config is not None else "the configuration in effect"
    job.set(phase, f"{prefix}measuring {in_effect}")
    return Baseline(job, job.search)


class Baseline(Phase):
    """The window of the configuration in effect, then the plan of the search."""

    def __init__(self, job: TunerJob, search: Search) -> None:
        super().__init__(job)
        self.search = search
        self.window: list[StepMetrics] = []

    def on_sample(self, m: StepMetrics) -> Phase:
        job, search, params = self.job, self.search, self.job.params
        self.window.append(m)
        if len(self.window) < search.window_steps:
            if len(self.window) == params.min_trial_steps + 2 and job.evidence.known:
                return self._warm_start(m) or self
            return self
        incumbent = MeasuredWindow(m.config, list(self.window), job.decision_in_effect or 0)
        self._adopt(incumbent)
        candidates, prediction = self._plan(incumbent, job.sigma)
        self._set_plan(incumbent, candidates, prediction)
        gate = -math.log1p(params.min_gain)
        if job.mode == "observe":
            return recommend(job, search, prediction, incumbent, gate)
        paying, best = exploring.paying(
            job,
            incumbent,
            [
                (c, float(mu), float(sd))
                for c, mu, sd in zip(prediction.candidates, prediction.mean, prediction.std)
                if c != incumbent.config
            ],
        )
        search.trials_planned = min(params.max_trials, len(paying))
        if not paying:
            return verifying.finish(job, search, exploring.none_pays(best))
        return exploring.next_trial(job, search)

    def _warm_start(self, m: StepMetrics) -> Phase | None:
        """Early in the baseline (min_trial_steps + 2 steps in), when earlier jobs of this shape
        measured this configuration in this context and their search held another one that wins
        here by more than min_gain at z_switch standard errors (tuner.evidence, judged as
        exploring.switch_known judges it): switch to it now, its verification window deciding,
        instead of measuring the rest of the baseline first, so that a second job of a model runs
        what the first one found ~20 steps in. Otherwise None, and nothing changed: the baseline
        runs its full window, as for a job nobody measured before."""
        job, params = self.job, self.job.params
        if job.mode != "auto":
            return None
        incumbent = MeasuredWindow(m.config, list(self.window), job.decision_in_effect or 0)
        # The noise as adopting this window would leave it; the job's state is not touched yet.
        candidates, prediction = self._plan(incumbent, job.noise_with(incumbent.samples)[1])
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
        self._adopt(incumbent)
        self._set_plan(incumbent, candidates, prediction)
        return exploring.switch_known(job, self.search, config, incumbent.median_s * math.exp(mu))

    def _adopt(self, incumbent: MeasuredWindow) -> None:
        """The baseline's window becomes the search's incumbent."""
        job = self.job
        job.incumbent = incumbent
        if job.starting is None:
            job.starting = incumbent
        job.learn_noise(incumbent.samples)
        job.record(incumbent)
        job.evidence.open_search(incumbent.config)

    def _plan(
        self, incumbent: MeasuredWindow, sigma: float
    ) -> tuple[tuple[Config, ...], Prediction]:
        """The candidates around `incumbent` and their predictions from its window: the model,
        corrected by this job's errors, combined with what earlier jobs measured here (`sigma`:
        the job's noise)."""
        job = self.job
        starting = job.starting.config if job.starting is not None else incumbent.config
        candidates = candidate_grid(job.shape, starting, around=incumbent.config)
        context = summarize(incumbent.samples, job.shape)
        prediction = job.evidence.with_known(
            job.evidence.corrected(
                job.predictor.predict(context, incumbent.config, candidates), incumbent.config
            ),
            incumbent,
            [incumbent, *self.search.trials],
            sigma,
        )
        return candidates, prediction

    def _set_plan(
        self, incumbent: MeasuredWindow, candidates: tuple[Config, ...], prediction: Prediction
    ) -> None:
        job = self.job
        job.candidates = candidates
        job.best_predicted_s = min(
            prediction.step_time_s(incumbent.median_s, i) for i in range(len(candidates))
        )


def recommend(
    job: TunerJob,
    search: Search,
    prediction: Prediction,
    incumbent: MeasuredWindow,
    gate: float,
) -> Phase:
    """Observe mode: record the predictor's confident best as a recommendation and watch."""
    confident = [
        (mu, c)
        for c, mu, sd in zip(prediction.candidates, prediction.mean, prediction.std)
        if mu - job.params.kappa * sd < gate and mu < gate
    ]
    phase = watching.hold(job, incumbent, incumbent.samples, search.window_steps)
    if not confident:
        job.set(
            "observing",
            f"observe: no configuration is predicted to beat {describe(incumbent.config)}",
        )
        return phase
    mu, best = min(confident, key=lambda t: t[0])
    predicted = incumbent.median_s * math.exp(mu)
    reason = (
        f"observe: recommend {describe(best)}, predicted "
        f"{describe_speedup(math.exp(-mu), describe(incumbent.config))}{search.context_note()}"
    )
    job.sink.decide(
        best, job.newest_step + job.params.apply_lead_steps, reason, predicted, "recommend"
    )
    job.recommended = best
    job.set(
        "observing",
        f"observe: recommends {describe(best)} (predicted "
        f"{describe_speedup(math.exp(-mu), describe(incumbent.config))})",
    )
    return phase


def abort(job: TunerJob, search: Search, moved: Alarm, in_effect: MeasuredWindow) -> Phase:
    """The context moved while a search ran: search again in the new context; but when that
    keeps happening (the context changes faster than a search completes), hold what is in
    effect and let the drift detector, with a raised bar, decide when to look again."""
    job.stats["retunes"] += 1
    job.aborts += 1
    job.fruitless += 1
    if moved.signal in JUMP_LIMITS and abs(moved.shift) > JUMP_LIMITS[moved.signal]:
        # A move this large shows in the context check of any trial it falls into
        # (drift.context_jump): the trials accepted so far were measured before it, so what
        # they taught about the predictor's errors on this job stands (a slow ramp would not
        # show there: its search's errors are dropped).
        job.evidence.keep_search_errors()
    job.evidence.drop_search_errors()
    if job.aborts < job.params.max_aborts:
        return start(
            job,
            f"re-tuning after {moved.reason}, during the search",
            new_segment=True,
            steps=job.params.rebaseline_steps,
        )
    phase = watching.hold(job, in_effect, in_effect.samples, search.window_steps)
    job.set(
        "holding",
        f"holding {describe(in_effect.config)}: the context changes faster than a "
        f"search completes ({moved.reason})",
    )
    return phase
