"""The per-job search, an explicit state machine fed with a job's step metrics (tuner.ranks):

    warm-up -> baseline -> exploring k/N -> (verifying) -> holding | no headroom
                  ^                                            |  drift (drift.py)
                  +---------------- re-tuning <----------------+

- warm-up: the first `warmup_steps` steps are ignored (allocation, first-use order recording).
- baseline: a window of the configuration in effect (the job's starting configuration the first
  time) gives the context, the noise level and the incumbent's step time.
- exploring: the predictor scores the whole candidate grid, and a candidate is tried only when the
  trial pays (`trial_value`, below), at most `max_trials` in a search. Before each trial the
  untried candidates are scored again from the best configuration measured so far, with the spread
  widened by the predictor's error on this search's measurements (a job the predictor does not
  know gets wider spreads, so fewer candidates are *likely* winners and each trial's expected
  loss grows). A trial: switch (a decision applied a few steps ahead), discard
  `transition_steps`, measure up to `trial_steps`; Wald's sequential probability ratio test on log
  step times cuts a trial that is clearly (`clearly_worse`) slower than the best measured so far as
  soon as `min_trial_steps` are in. A trial whose context figures jumped more than a configuration
  explains (drift.context_jump) against the incumbent *and* against every configuration already
  measured in this search (a jump another configuration of this search shows too is the
  configurations', e.g. the bandwidth estimate of tiny partitions against large ones) is checked:
  the incumbent is measured again, and if it moved too, the search restarts in the new context.
  A check (and the end-of-search confirm) is a sequential test with two looks: after
  `min_trial_steps` steps it ends as soon as the trial beats both measurements of the incumbent
  (`_beats_both`: then no move of the context explains the gain away), else at its full window;
  a check after the search's winner was measured that found the incumbent where it was is that
  winner's A-B-A, and no separate confirm follows.
- when a trial pays: the predicted log ratio X of a candidate to the best measured configuration
  is taken as Normal(mean, spread) (the ensemble's mean and spread, widened as above). From the
  costs of the search itself, not from any scenario:
  - it *wins* when X < -log(1 + min_gain) (only then does the search switch); the probability of
    that, p_win, must be at least 1/2: a trial more likely to be rolled back than kept is
    exploration the job pays for in steps, and the share of trials that measure a gain is p_win
    on average when the spread is calibrated (the issue's goal: at least half of them);
  - its expected net value in steps, H x E[(1 - e^X) 1{win}] - E[(e^X - 1) n(X)] - s, must be
    positive: the gain per step of a winner over the steps H it is expected to be held, against
    the excess of the trial's own n steps (transition + window; only transition +
    min_trial_steps when the sequential test cuts it, X > log(1 + clearly_worse)) and the s = 2
    steps its two switches cost (the first step after a switch waits for the previous step's
    all-reduces without overlap: at most a step each). Because the sequential test bounds a
    losing trial's cost, a likely winner nearly always pays over a horizon of a few dozen steps;
    the value decides where contexts are shorter than that, and ranks the candidates. H is the
    context's expected remaining lifetime: context changes are taken as a memoryless (Poisson)
    process, whose expected remaining time is its mean, estimated from this job's own changes
    (observed time + `context_prior_s`) / (changes + 1): a job whose context changes every
    minute gets a horizon of about a minute and stops paying for trials that need more to win
    back their steps. Of the candidates that pay, the one with the largest value is tried.
  When none pays the job is told at once: "no headroom" (after a re-tune: "no headroom after
  bandwidth drop: ..."), instead of searching to the end.
- the gain calibration (`gain_calibration`): before each further trial, the predicted log ratios
  of the untried candidates are multiplied by the slope of what this search's trials measured
  against what the model predicted for them (a prior slope of 1 that one or two trials can
  overturn; TunerParams says where its two constants come from). A search's first trials are the
  model's most optimistic predictions, so when they measure none of their predicted gain, the
  rest of the list is taken to be as optimistic and the search ends ("no trial beat it") instead
  of spending max_trials; where they measured what was predicted, nothing changes.
- what earlier jobs of this shape measured (`known`: their windows, the job's fingerprint, world
  size and backend equal): where one of them measured the search's reference configuration in
  the same context (bandwidth estimate, compute and host load within the drift test's minimum
  relevant shifts of what the reference measures now; or another configuration this search
  measured, the ratio chained through it) and a candidate in the same context segment, that
  measured ratio is combined with the model's prediction, precision-weighted (the model's spread,
  widened by its error on the ratios those jobs measured, against the measurement's standard
  error); the model's mean error there (its bias for this job, shrunk) corrects the candidates
  nobody measured. A model trained on many jobs predicts *this*
  job's landscape only roughly; its own earlier measurement in the same context predicts it to a
  few percent: so the second job of a model goes to the configuration that won for the first one
  (and not to those that lost), and needs fewer trials than the first. Where that combined
  prediction says the earlier winner wins by more than `min_gain` at `z_switch` spreads, the
  search switches to it *without a trial* (`_switch_known`, "warm start: ..."): its verification
  window keeps it when it measures at least `min_gain` over the incumbent; otherwise it counts as
  a lost trial and the search goes on. When a trial's winner is the
  configuration an earlier job held after its search in the same context (tried first when its
  trial pays), the search ends there:
  that search already paid for the trials from it (without this, a model retrained on the first
  job's windows extrapolated its measured gain to the winner's neighbours, and the second job
  tried them: more trials than the first, none of them a gain).
- the best measured configuration wins only if it beats the incumbent by more than `min_gain` and
  by `z_switch` standard errors (hysteresis); otherwise the incumbent stays. The first time, when
  the incumbent is the job's starting configuration, that is "no headroom" and the job is told so.
- verifying: after switching to the winner, one window checks it: if the context moved meanwhile
  (drift.window_shift), re-tune; if it is slower than the incumbent beyond the noise, roll back.
- holding / no headroom: drift.DriftDetector watches the held configuration; an alarm opens a new
  context segment and re-tunes (a short baseline, then the predictor's top candidates for the new
  context).
- paused: an operator decided (`autobyte propose`) or paused it; only a resume ends it.
- observe mode (`autobyted start --tuner observe`): baseline, then a *recommendation* (stored,
  never pushed) and watching; no trials.

Nothing here does I/O: decisions, measured effects, windows and status go to a `TunerSink`
(the daemon's writes to storage and the control path; the benchmark's simulator adapter).
Constants and how they were chosen: `TunerParams` (`tuner.params`); the candidates: `tuner.grid`.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence

from autobyte.types import Config, StepMetrics, describe_speedup, speedup

from autobyted.storage.records import TunerStatusRecord
from autobyted.tuner.drift import (
    JUMP_LIMITS,
    Alarm,
    DriftDetector,
    context_jump,
    fastest_in_context,
    robust_sigma,
    window_shift,
)
from autobyted.tuner.evidence import JobEvidence
from autobyted.tuner.features import JobShape, summarize
from autobyted.tuner.grid import candidate_grid, describe
from autobyted.tuner.measured import MeasuredWindow, PendingDecision
from autobyted.tuner.params import TunerParams
from autobyted.tuner.predictor import Prediction, Predictor, Window
from autobyted.tuner.sink import TunerSink
from autobyted.tuner.verdict import (
    TrialValue,
    beats,
    beats_both,
    clearly_worse,
    gain_calibration,
    rolls_back,
    step_time_move,
    trial_value,
)

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

log = logging.getLogger(__name__)
RECENT_STEPS = 20  # the held configuration's latest steps, the context a rescore predicts from

_Valued = tuple[
    Config, float, TrialValue
]  # (candidate, predicted mean log ratio, its trial's value)


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
        self.evidence = JobEvidence(job, shape, known, first_segment)
        self.job, self.shape, self.predictor, self.sink, self.mode, self.params = (
            job,
            shape,
            predictor,
            sink,
            mode,
            params,
        )
        self.phase = "warm-up"
        self.detail = f"warm-up (first {params.warmup_steps} steps)"
        self.first_segment = self.segment = first_segment
        self.config: Config | None = None  # in effect, from the newest sample
        self.decision_in_effect: int | None = None
        self.newest_step = -1
        self.newest_wall_s = 0.0
        self.first_wall_s: float | None = None  # the job's first sample (the horizon's clock)
        self.cleared: set[tuple[str, int]] = (
            set()
        )  # context jumps a check showed to be the configs'
        self.checked: list[
            MeasuredWindow
        ] = []  # this search's trials a check of the incumbent followed (A-B-A)
        self.own_decision_ids: set[int] = set()
        self.pending: PendingDecision | None = None
        self.transition_steps_left = 0
        self.window: list[StepMetrics] = []
        self.window_steps = params.baseline_steps
        self.incumbent: MeasuredWindow | None = None
        self.starting: MeasuredWindow | None = None
        self.searched_once = False
        self.retune_reason = ""
        self.sigma = params.sigma_floor
        self.residuals: list[float] = []  # log step time minus its window's median, recent windows
        self.trials: list[MeasuredWindow] = []
        self.trial: MeasuredWindow | None = None
        self.trials_planned = 0
        self.winner: MeasuredWindow | None = None
        self.switch_decision_id = 0
        self.held: MeasuredWindow | None = None
        self.detector: DriftDetector | None = None
        self.best_predicted_s = 0.0
        self.paused = False
        self.suspect_trial: tuple[MeasuredWindow, Alarm] | None = None
        self.check_decision_id = 0
        self.fruitless = 0  # re-tunes in a row that kept the configuration
        self.confirmed = False  # the incumbent was measured again at the end of this search
        self.aborts = 0  # searches in a row that the context moved under
        self.step_s = 0.0  # recent step time (sizes windows in time)
        self.recent: list[StepMetrics] = []  # while holding: its latest steps
        self.next_rescore_wall_s = 0.0
        self.candidates: tuple[Config, ...] = ()
        # Counters the benchmarks read (never steer anything).
        self.stats = {
            "trials": 0,
            "cut": 0,
            "switches": 0,
            "rollbacks": 0,
            "retunes": 0,
            "not_applied": 0,
        }
        self.recommended: Config | None = None

    # ------------------------------------------------------------------ public
    def observe(self, samples: Sequence[StepMetrics]) -> None:
        for sample in samples:
            self._on_sample(sample)

    def pause(self, why: str = "an operator decided") -> None:
        if self.paused:
            return
        self.paused = True
        self.pending = None
        self.trial = None
        self._set("paused", f"paused: {why}; `autobyte tune {self.job} --resume` hands it back")

    def resume(self) -> None:
        if not self.paused:
            return
        self.paused = False
        self.searched_once = False  # the operator's configuration is the new starting point
        self.starting = None
        self._rebaseline(
            "resumed after an operator's pause", new_segment=True, steps=self.params.baseline_steps
        )

    @property
    def status(self) -> TunerStatusRecord:
        held = self.held or self.incumbent
        return TunerStatusRecord(
            mode=self.mode,
            state=self.phase,
            detail=self.detail,
            config=(
                self.recommended
                if self.mode == "observe" and self.recommended
                else held.config
                if held
                else self.config
            )
            or Config(),
            baseline_step_time_s=self.starting.median_s if self.starting else 0.0,
            measured_step_time_s=held.median_s if held else 0.0,
            predicted_step_time_s=self.best_predicted_s,
            trials_done=len(self.trials),
            trials_planned=self.trials_planned,
            paused=self.paused,
        )

    # ------------------------------------------------------------------ per sample
    def _on_sample(self, m: StepMetrics) -> None:
        if m.step <= self.newest_step:
            return  # a resent or reordered sample
        if not (m.step_time_s > 0 and math.isfinite(m.step_time_s)):
            return  # not a measurement (the daemon's checks allow 0)
        self.newest_step = m.step
        self.newest_wall_s = m.wall_time_s
        if self.first_wall_s is None:
            self.first_wall_s = m.wall_time_s
        self.step_s = m.step_time_s if not self.step_s else 0.9 * self.step_s + 0.1 * m.step_time_s
        self.config = m.config
        changed = self.decision_in_effect is not None and m.decision_id != self.decision_in_effect
        self.decision_in_effect = m.decision_id
        if m.step < self.params.warmup_steps:
            return
        if self.paused:
            return
        if self.pending is not None:
            if m.decision_id == self.pending.decision_id:
                self.pending = None
                self.transition_steps_left = self.params.transition_steps
            elif (
                m.step >= self.pending.apply_at_step + self.params.apply_timeout_steps
                and m.wall_time_s - self.pending.issued_wall_s > self.params.apply_timeout_s
            ):
                self._not_applied()
                return
            else:
                return  # the job has not switched yet: these steps belong to the previous plan
        elif changed and m.decision_id not in self.own_decision_ids:
            # Someone else's decision took effect (an operator's, or one from before a restart).
            self._rebaseline(
                f"configuration changed to {describe(m.config)} by decision #{m.decision_id}",
                new_segment=True,
                steps=self.params.baseline_steps,
            )
            self.transition_steps_left = self.params.transition_steps
        if self.transition_steps_left > 0:
            self.transition_steps_left -= 1
            return
        if self.phase == "warm-up":
            self._rebaseline("", new_segment=False, steps=self.params.baseline_steps)
        handler = {
            "baseline": self._on_baseline,
            "re-tuning": self._on_baseline,
            "exploring": self._on_trial,
            "checking": self._on_check,
            "confirming": self._on_confirm,
            "verifying": self._on_verify,
        }.get(self.phase, self._on_watch)
        handler(m)

    # ------------------------------------------------------------------ baseline and planning
    def _rebaseline(self, reason: str, new_segment: bool, steps: int) -> None:
        if new_segment:
            self.segment += 1
        self.retune_reason = reason
        self.cleared, self.checked = set(), []
        self.window = []
        self.window_steps = self._window(steps, self.params.baseline_window_s)
        self.trials, self.trial, self.winner, self.detector = [], None, None, None
        self.held = None  # what is measured from now on is the new context's incumbent
        self.confirmed = False
        self.trials_planned = 0
        phase = "re-tuning" if reason else "baseline"
        prefix = f"{reason}: " if reason else ""
        # Before the job's next step the tuner may not know what is in effect (a tuner opened on a
        # running job reads from its newest step): say so rather than print none/inf.
        in_effect = (
            describe(self.config) if self.config is not None else "the configuration in effect"
        )
        self._set(phase, f"{prefix}measuring {in_effect}")

    def _on_baseline(self, m: StepMetrics) -> None:
        self.window.append(m)
        if len(self.window) < self.window_steps:
            return
        incumbent = MeasuredWindow(m.config, list(self.window), self.decision_in_effect or 0)
        self.incumbent = incumbent
        if self.starting is None:
            self.starting = incumbent
        self._learn_noise(incumbent.samples)
        self._record(incumbent)
        self.evidence.open_search(incumbent.config)
        self.candidates = candidate_grid(self.shape, self.starting.config)
        context = summarize(incumbent.samples, self.shape)
        prediction = self.evidence.with_known(
            self.evidence.corrected(
                self.predictor.predict(context, incumbent.config, self.candidates), incumbent.config
            ),
            incumbent,
            [self.incumbent, *self.trials],
            self.sigma,
        )
        self.best_predicted_s = min(
            prediction.step_time_s(incumbent.median_s, i) for i in range(len(self.candidates))
        )
        gate = -math.log1p(self.params.min_gain)
        if self.mode == "observe":
            self._recommend(prediction, incumbent, gate)
            return
        paying, _best = self._paying(
            incumbent,
            [
                (c, float(mu), float(sd))
                for c, mu, sd in zip(prediction.candidates, prediction.mean, prediction.std)
                if c != incumbent.config
            ],
        )
        self.trials_planned = min(self.params.max_trials, len(paying))
        if not paying:
            self._finish(self._none_pays(_best))
            return
        self._next_trial()

    def _horizon_steps(self, step_s: float) -> float:
        """Steps the winner of a search is expected to be held: the context's expected remaining
        lifetime (memoryless changes: the mean lifetime, from this job's own changes and
        `context_prior_s`), in steps of `step_s`."""
        elapsed_s = max(0.0, self.newest_wall_s - (self.first_wall_s or self.newest_wall_s))
        lifetime_s = (elapsed_s + self.params.context_prior_s) / (
            self.segment - self.first_segment + 1
        )
        return lifetime_s / max(step_s, 1e-6)

    def _paying(
        self, reference: MeasuredWindow, scored: Sequence[tuple[Config, float, float]]
    ) -> tuple[list[_Valued], _Valued | None]:
        """Of (candidate, mean, spread) predicted against `reference`, the ones whose trial pays
        (trial_value), best value first; and the best of all (for the reason when none pays)."""
        horizon = self._horizon_steps(reference.median_s)
        trial = self.params.transition_steps + self._window(
            self.params.trial_steps, self.params.trial_window_s
        )
        cut = self.params.transition_steps + self.params.min_trial_steps
        valued = sorted(
            (
                (
                    c,
                    mu,
                    trial_value(
                        mu, sd, horizon, trial, cut, self.params.min_gain, self.params.clearly_worse
                    ),
                )
                for c, mu, sd in scored
            ),
            key=lambda t: -t[2].value_steps,
        )
        paying = [t for t in valued if t[2].pays]
        best = max(valued, key=lambda t: t[2].win_probability, default=None)
        return paying, best

    def _none_pays(self, best: _Valued | None) -> str:
        if best is None:
            return "no candidate left to try"
        config, mu, value = best
        return (
            f"no trial is likely to win more than it costs; the likeliest, {describe(config)}, "
            f"predicted {describe_speedup(math.exp(-mu), 'the incumbent')}, "
            f"{100 * value.win_probability:.0f}% likely to win"
        )

    def _recommend(self, prediction: Prediction, incumbent: MeasuredWindow, gate: float) -> None:
        confident = [
            (mu, c)
            for c, mu, sd in zip(prediction.candidates, prediction.mean, prediction.std)
            if mu - self.params.kappa * sd < gate and mu < gate
        ]
        self._hold(incumbent, watch_reference=incumbent.samples)
        if not confident:
            self._set(
                "observing",
                f"observe: no configuration is predicted to beat {describe(incumbent.config)}",
            )
            return
        mu, best = min(confident, key=lambda t: t[0])
        predicted = incumbent.median_s * math.exp(mu)
        reason = (
            f"observe: recommend {describe(best)}, predicted "
            f"{describe_speedup(math.exp(-mu), describe(incumbent.config))}{self._context_note()}"
        )
        self.sink.decide(
            best, self.newest_step + self.params.apply_lead_steps, reason, predicted, "recommend"
        )
        self.recommended = best
        self._set(
            "observing",
            f"observe: recommends {describe(best)} (predicted "
            f"{describe_speedup(math.exp(-mu), describe(incumbent.config))})",
        )

    def _context_note(self) -> str:
        return f" ({self.retune_reason})" if self.retune_reason else ""

    # ------------------------------------------------------------------ trials
    def _next_trial(self) -> None:
        """Score every untried candidate from the best configuration measured so far (the predictor
        is relative, and a near reference predicts best), widen the predictor's spread by its
        measured error on this search (the configurations already measured, predicted from the same
        reference: a job unlike anything the predictor knows shows large errors and gets explored),
        and try the best optimistic bound if it beats the best measurement by more than min_gain,
        among the candidates whose mean predicts a gain."""
        incumbent = self.incumbent
        assert incumbent is not None
        measured = [incumbent] + [t for t in self.trials if not t.cut]
        reference = min(measured, key=lambda t: t.log_median)
        tried = {t.config for t in self.trials} | {incumbent.config}
        untried = [c for c in self.candidates if c not in tried]
        if not untried or len(self.trials) >= self.params.max_trials:
            self._finish("")
            return
        if reference is not incumbent and self.evidence.held_before(reference):
            # An earlier job of this shape searched this context and held this configuration:
            # what it tried from here is in its windows, and this job measured the same winner.
            self._finish("")
            return
        context = summarize(reference.samples, self.shape)
        others = [t for t in measured + [t for t in self.trials if t.cut] if t is not reference]
        prediction = self.evidence.corrected(
            self.predictor.predict(context, reference.config, untried + [t.config for t in others]),
            reference.config,
        )
        prediction = self.evidence.with_known(
            prediction, reference, [self.incumbent, *self.trials], self.sigma, len(untried)
        )
        slope = gain_calibration(
            [
                (t.model_log, t.log_median - t.reference_log)
                for t in self.trials
                if t.model_log is not None
            ],
            self.params.gain_slope_prior_sd,
            self.params.gain_error_sd,
        )
        uncalibrated = {c: float(mu) for c, mu in zip(untried, prediction.mean[: len(untried)])}
        residuals = [
            (t.log_median - reference.log_median) - slope * float(mu)
            for t, mu in zip(others, prediction.mean[len(untried) :])
        ]
        error2 = statistics.mean(r * r for r in residuals) if residuals else 0.0
        scored = [
            (c, slope * float(mu), math.sqrt(float(sd) ** 2 + error2))
            for c, mu, sd in zip(
                untried, prediction.mean[: len(untried)], prediction.std[: len(untried)]
            )
        ]
        paying, best = self._paying(reference, scored)
        if not paying:
            self._finish("" if self.trials else self._none_pays(best))
            return
        # What an earlier search in this context ended holding is tried first (its measurement is
        # the surest gain; if it wins again, that search's trials from it need not be repeated).
        config, mu, _value = next(
            (t for t in paying if t[0] in self.evidence.known_winners), paying[0]
        )
        predicted = reference.median_s * math.exp(mu)
        spread = next(sd for c, _mu, sd in scored if c == config)
        if (
            config in self.evidence.known_winners
            and not self.trials
            and reference is incumbent
            and mu + self.params.z_switch * spread < -math.log1p(self.params.min_gain)
        ):
            self._switch_known(config, predicted)
            return
        number = len(self.trials) + 1
        self.trials_planned = max(self.trials_planned, number)
        reason = (
            f"trial {number}/{self.trials_planned}: {describe(config)} predicted "
            f"{self._versus_incumbent(predicted)}{self._context_note()}"
        )
        decision = self._decide(config, reason, predicted, "trial")
        if decision is None:
            return
        self.trial = MeasuredWindow(
            config,
            [],
            decision,
            math.log(predicted) - incumbent.log_median,
            model_log=uncalibrated[config],
            reference_log=reference.log_median,
        )
        prefix = f"{self.retune_reason}: " if self.retune_reason else ""
        self._set(
            "exploring", f"{prefix}exploring {number}/{self.trials_planned} {describe(config)}"
        )

    def _versus_incumbent(self, step_time_s: float) -> str:
        """'1.12x faster than 4MiB/16MiB': a step time against the search's incumbent."""
        assert self.incumbent is not None
        return describe_speedup(
            speedup(self.incumbent.median_s, step_time_s), describe(self.incumbent.config)
        )

    def _switch_known(self, config: Config, predicted: float) -> None:
        """Warm start: an earlier job of this shape held `config` after its search in this context,
        and what it measured (with the model) says it wins by more than min_gain at z_switch
        standard errors: switch to it without a trial; its verification window decides (kept when
        it measures at least min_gain over the incumbent, else it counts as a lost trial and the
        search goes on)."""
        incumbent = self.incumbent
        assert incumbent is not None
        reason = (
            f"warm start: {describe(config)}, held by an earlier job of this model in this context, "
            f"predicted {self._versus_incumbent(predicted)}{self._context_note()}; switching without a trial"
        )
        decision = self._decide(config, reason, predicted, "switch")
        if decision is None:
            return
        self.winner = MeasuredWindow(
            config, [], decision, math.log(predicted) - incumbent.log_median
        )
        self.confirmed = True
        self.switch_decision_id = decision
        self.stats["switches"] += 1
        self.window = []
        self.window_steps = self._window(self.params.trial_steps, self.params.trial_window_s)
        self._set(
            "verifying",
            f"switching to {describe(config)} (an earlier job's winner here), verifying",
        )

    def _on_trial(self, m: StepMetrics) -> None:
        trial = self.trial
        if trial is None:
            return
        trial.samples.append(m)
        n = len(trial.samples)
        length = self._window(self.params.trial_steps, self.params.trial_window_s)
        if n >= self.params.min_trial_steps and n < length and self._clearly_worse(trial):
            trial.cut = True
        if not trial.cut and n < length:
            return
        self.trial = None
        assert self.incumbent is not None
        jump = self._unexplained_jump(trial)
        self.stats["trials"] += 1
        self.sink.close_decision(
            trial.decision_id, trial.median_s, "rolled_back" if trial.cut else None
        )
        # A check costs its window at the incumbent's step time (3x the trial's from a poor start),
        # and it can change the answer only when the context the trial ran in could have made the
        # incumbent as fast as the trial (drift.fastest_in_context): a trial faster than that bound
        # by the switch margin wins whatever the measured context did, and goes on unchecked (the
        # search's end still measures the incumbent again against what no signal shows: confirm).
        fastest = fastest_in_context(self.incumbent.samples, trial.samples)
        if (
            jump is not None
            and not trial.cut
            and trial.median_s * (1 + self.params.min_gain) < fastest
        ):
            log.debug(
                "%s: %s during trial %d cannot explain its %.0f ms (the incumbent at best %.0f ms): no check",
                self.job,
                jump.reason,
                len(self.trials) + 1,
                trial.median_s * 1e3,
                fastest * 1e3,
            )
            jump = None
        if jump is not None and (jump.signal, jump.direction) not in self.cleared:
            # A jump no configuration explains: did the context move while the trial ran? Measure
            # the incumbent again before trusting the comparison.
            self.suspect_trial = (trial, jump)
            check_steps = self._window(self.params.rebaseline_steps, self.params.baseline_window_s)
            reason = (
                f"check: {jump.reason} during trial {len(self.trials) + 1}? it could explain the "
                f"trial's {trial.median_s * 1e3:.0f} ms (the incumbent at best {fastest * 1e3:.0f} ms): "
                f"measuring {describe(self.incumbent.config)} again, ~{check_steps} steps"
            )
            decision = self.check_decision_id = self._decide(
                self.incumbent.config, reason, self.incumbent.median_s, "check"
            )
            if decision is None:
                return
            self.window = []
            self.window_steps = self._window(
                self.params.rebaseline_steps, self.params.baseline_window_s
            )
            self._set("checking", f"checking whether the context changed ({jump.reason}?)")
            return
        self._accept_trial(trial)

    def _unexplained_jump(self, trial: MeasuredWindow) -> Alarm | None:
        """The trial's context jump against the incumbent (drift.context_jump), unless the trial's
        context figures agree with those of another configuration measured in this search: then the
        jump is what configurations do to the figures, not the context moving (a 64 KiB partition's
        bandwidth estimate against a 4 MiB one's)."""
        assert self.incumbent is not None
        jump = context_jump(self.incumbent.samples, trial.samples)
        if jump is None or any(
            context_jump(other.samples, trial.samples) is None for other in self.trials
        ):
            return None
        return jump

    def _early_window(
        self, before: MeasuredWindow, trial: MeasuredWindow | None
    ) -> MeasuredWindow | None:
        """The incumbent measured again (a check's or a confirm's window), at the sequential look
        after `min_trial_steps` steps: the window so far when `trial` already beats both
        measurements of the incumbent (the answer of the full window cannot change then); else
        None (measure on)."""
        if (
            trial is None
            or len(self.window) != self.params.min_trial_steps
            or len(self.window) >= self.window_steps
        ):
            return None
        again = MeasuredWindow(before.config, list(self.window))
        return again if self._beats_both(trial, before, again) else None

    def _accept_trial(self, trial: MeasuredWindow) -> None:
        assert self.incumbent is not None
        # What the predictor got wrong about this configuration, for this job (kept across
        # segments: a bias of the model for this job and machine outlives a context change).
        # Committed when the search ends cleanly, or when what interrupted it was a jump of the
        # context large enough to show in a trial's own context check (_abort); not when the
        # context moved under the search more gently (a ramp is no evidence); clipped.
        error = (trial.log_median - self.incumbent.log_median) - trial.predicted_log
        self.evidence.add_search_error(trial.config, error)
        self._learn_noise(trial.samples)
        self.trials.append(trial)
        self.stats["cut"] += trial.cut
        self._record(trial)
        self._next_trial()

    def _on_check(self, m: StepMetrics) -> None:
        """The incumbent measured again after a suspicious trial: same context -> the trial counts;
        moved -> re-tune in the new context."""
        self.window.append(m)
        incumbent, (trial, _jump) = self.incumbent, self.suspect_trial
        assert incumbent is not None
        early = self._early_window(incumbent, trial)
        if early is None and len(self.window) < self.window_steps:
            return
        again = early or MeasuredWindow(incumbent.config, list(self.window))
        self.sink.close_decision(self.check_decision_id, again.median_s, None)
        self.suspect_trial = None
        if early is not None:
            # The trial beats the incumbent before and after it by the switch margin: the comparison
            # holds whatever the context did (not measured long enough to clear the jump itself).
            self.checked.append(trial)
            self._accept_trial(trial)
            return
        shift = self._moved(incumbent, again)
        if shift is None or self._beats_both(trial, incumbent, again):
            # Same context, or a move smaller than the trial's gain: the comparison holds either way.
            # Same context: every trial so far was measured between two equal measurements of the
            # incumbent (their A-B-A); a move: the suspect trial alone beat both.
            self.checked.extend([*self.trials, trial] if shift is None else [trial])
            self.cleared.add((_jump.signal, _jump.direction))
            self._accept_trial(trial)
            return
        self._abort(shift, again)

    def _clearly_worse(self, trial: MeasuredWindow) -> bool:
        """Wald's SPRT on log step times against the best configuration measured in this search
        (the incumbent until a trial beats it): H0 mean = its log median, H1 = that +
        log(1 + clearly_worse), sigma = the job's pooled noise; True when H1 is accepted."""
        assert self.incumbent is not None
        best = min([self.incumbent.log_median] + [t.log_median for t in self.trials if not t.cut])
        return clearly_worse((s.step_time_s for s in trial.samples), best, self.sigma, self.params)

    def _finish(self, why: str) -> None:
        """End of a search: pick the winner (hysteresis), switch to it if needed, verify."""
        incumbent = self.incumbent
        assert incumbent is not None
        winner = incumbent
        for trial in self.trials:
            if trial.cut:
                continue
            if (
                beats(
                    trial.log_median,
                    len(trial.samples),
                    incumbent.log_median,
                    len(incumbent.samples),
                    self.sigma,
                    self.params,
                )
                and trial.log_median < winner.log_median
            ):
                winner = trial
        self.winner = winner
        # A re-tune that ends where it started was not worth it: raise the bar for the next one (the
        # host's own ups and downs, e.g. a neighbour's load on a shared machine); a re-tune that
        # switched resets it.
        if self.retune_reason:
            self.fruitless = self.fruitless + 1 if winner is incumbent else 0
        if (
            winner is not incumbent
            and not self.confirmed
            and not any(t is winner for t in self.checked)
        ):
            # Before trusting a comparison made over a whole search, measure the incumbent again
            # (an A-B-A design): if it moved, the context drifted while the trials ran (a ramp, a
            # neighbour), and the search is repeated in the context as it is now.
            check_steps = self._window(self.params.rebaseline_steps, self.params.baseline_window_s)
            reason = (
                f"confirm: measuring {describe(incumbent.config)} again before switching to "
                f"{describe(winner.config)} (~{check_steps} steps, {self.params.min_trial_steps} when the winner "
                f"beats both measurements){self._context_note()}"
            )
            decision = self.check_decision_id = self._decide(
                incumbent.config, reason, incumbent.median_s, "check"
            )
            if decision is None:
                return
            self.window = []
            self.window_steps = self._window(
                self.params.rebaseline_steps, self.params.baseline_window_s
            )
            self._set(
                "confirming",
                f"measuring {describe(incumbent.config)} again before switching to "
                f"{describe(winner.config)}",
            )
            return
        if winner.config == self.config:
            # Already in effect (nothing was tried, or it is the incumbent): its window is the proof.
            self._settle_winner(winner, winner.samples, why)
            return
        returning = winner is incumbent
        reason = (
            f"return to {describe(winner.config)}: no trial beat it{self._context_note()}"
            if returning
            else f"hold best: {describe(winner.config)} measured {self._measured_gain(winner)}"
            f"{self._context_note()}"
        )
        decision = self._decide(
            winner.config, reason, winner.median_s, "return" if returning else "switch"
        )
        if decision is None:
            return
        self.switch_decision_id = decision
        self.stats["switches"] += not returning
        self.window = []
        self.window_steps = self._window(
            self.params.rebaseline_steps, self.params.baseline_window_s
        )
        self._set("verifying", f"switching to {describe(winner.config)}, verifying")

    def _on_confirm(self, m: StepMetrics) -> None:
        self.window.append(m)
        incumbent = self.incumbent
        assert incumbent is not None
        early = self._early_window(incumbent, self.winner)
        if early is None and len(self.window) < self.window_steps:
            return
        again = early or MeasuredWindow(incumbent.config, list(self.window))
        self.sink.close_decision(self.check_decision_id, again.median_s, None)
        moved = None if early is not None else self._moved(incumbent, again)
        if moved is not None and not (
            self.winner is not None and self._beats_both(self.winner, incumbent, again)
        ):
            self._abort(moved, again)
            return
        self.confirmed = True
        self._finish("")

    def _beats_both(
        self, trial: MeasuredWindow, before: MeasuredWindow, after: MeasuredWindow
    ) -> bool:
        """The incumbent measured before and after a trial: if the trial beats both measurements by
        the switch margin, it beats the incumbent in any context in between; a context that moved
        less than the gain cannot explain the gain away (a 10x better configuration on a noisy host)."""
        return beats_both(
            trial.log_median,
            len(trial.samples),
            before.log_median,
            after.log_median,
            min(len(before.samples), len(after.samples)),
            self.sigma,
            self.params,
        )

    def _abort(self, moved: Alarm, in_effect: MeasuredWindow) -> None:
        """The context moved while a search ran: search again in the new context; but when that
        keeps happening (the context changes faster than a search completes), hold what is in
        effect and let the drift detector, with a raised bar, decide when to look again."""
        self.stats["retunes"] += 1
        self.aborts += 1
        self.fruitless += 1
        if moved.signal in JUMP_LIMITS and abs(moved.shift) > JUMP_LIMITS[moved.signal]:
            # A move this large shows in the context check of any trial it falls into
            # (drift.context_jump): the trials accepted so far were measured before it, so what
            # they taught about the predictor's errors on this job stands (a slow ramp would not
            # show there: its search's errors are dropped).
            self.evidence.keep_search_errors()
        self.evidence.drop_search_errors()
        if self.aborts < self.params.max_aborts:
            self._rebaseline(
                f"re-tuning after {moved.reason}, during the search",
                new_segment=True,
                steps=self.params.rebaseline_steps,
            )
            return
        self._hold(in_effect, watch_reference=in_effect.samples)
        self._set(
            "holding",
            f"holding {describe(in_effect.config)}: the context changes faster than a "
            f"search completes ({moved.reason})",
        )

    def _moved(self, before: MeasuredWindow, after: MeasuredWindow) -> Alarm | None:
        """The same configuration measured twice: did its context (or its step time) move?"""
        shift = window_shift(before.samples, after.samples)
        if shift is not None:
            return shift
        moved = step_time_move(
            before.log_median,
            len(before.samples),
            after.log_median,
            len(after.samples),
            self.sigma,
            self.params,
        )
        if moved is not None:
            return Alarm(
                "step_time",
                1 if moved > 0 else -1,
                moved,
                "step time rise" if moved > 0 else "step time drop",
            )
        return None

    def _on_verify(self, m: StepMetrics) -> None:
        self.window.append(m)
        if len(self.window) < self.window_steps:
            return
        winner, incumbent = self.winner, self.incumbent
        assert winner is not None and incumbent is not None
        measured = MeasuredWindow(winner.config, list(self.window), self.switch_decision_id)
        self._learn_noise(measured.samples)
        self.sink.close_decision(self.switch_decision_id, measured.median_s, None)
        if not winner.samples and winner is not incumbent:  # a warm start's switch (_switch_known)
            if incumbent.log_median - measured.log_median >= math.log1p(self.params.min_gain):
                winner.samples.extend(measured.samples)
                self._record(measured)
                self._settle_winner(winner, measured.samples, "")
            else:  # it did not win here: a lost trial; the search goes on from the incumbent
                self.stats["trials"] += 1
                self.confirmed = False
                measured.predicted_log = winner.predicted_log
                self._accept_trial(measured)
            return
        shift = window_shift(winner.samples, measured.samples)
        if shift is not None:
            self._abort(shift, measured)
            return
        if winner is not incumbent and rolls_back(
            measured.log_median,
            len(measured.samples),
            incumbent.log_median,
            len(incumbent.samples),
            self.sigma,
            self.params,
        ):
            self.stats["rollbacks"] += 1
            self.sink.close_decision(self.switch_decision_id, measured.median_s, "rolled_back")
            reason = (
                f"rollback: {describe(winner.config)} measured {measured.median_s * 1e3:.1f} ms, "
                f"{describe(incumbent.config)} {incumbent.median_s * 1e3:.1f} ms"
            )
            decision = self._decide(incumbent.config, reason, incumbent.median_s, "rollback")
            if decision is None:
                return
            self.switch_decision_id = decision
            self.winner = incumbent
            self.window = []
            self._set("verifying", f"rolled back to {describe(incumbent.config)}, verifying")
            return
        self._record(measured)
        self._settle_winner(winner, measured.samples, "")

    def _settle_winner(
        self, winner: MeasuredWindow, reference: list[StepMetrics], why: str
    ) -> None:
        self.aborts = 0
        self.evidence.keep_search_errors()
        first = not self.searched_once
        self.searched_once = True
        starting = self.starting
        assert starting is not None
        self._hold(
            MeasuredWindow(winner.config, list(reference), winner.decision_id),
            watch_reference=reference,
        )
        held_context = summarize(reference, self.shape)
        prediction = self.predictor.predict(held_context, winner.config, self.candidates)
        self.best_predicted_s = min(
            prediction.step_time_s(statistics.median(s.step_time_s for s in reference), i)
            for i in range(len(self.candidates))
        )
        if winner.config == starting.config and first:
            note = f" ({why})" if why else ""
            tried = (
                f"nothing beat the starting configuration {describe(starting.config)}"
                if self.trials
                else f"the starting configuration {describe(starting.config)} stays, no trial made"
            )
            self._set("no headroom", f"no headroom: {tried}{note}")
            return
        held, incumbent = self.held, self.incumbent
        assert held is not None and incumbent is not None
        if held.config == incumbent.config and self.retune_reason:
            # A new context in which nothing is worth switching to: say so, and why, at once.
            reason = self.retune_reason
            head = (
                f"no headroom after {reason.removeprefix('re-tuning after ')}"
                if reason.startswith("re-tuning after ")
                else f"no headroom ({reason})"
            )
            self._set(
                "no headroom",
                f"{head}: {describe(held.config)} stays"
                f"{f' ({why})' if why else ': no trial beat it'}",
            )
            return
        if held.config == incumbent.config:
            gain = "no candidate beat it"
        else:
            # The figure of the decision that switched (the same two windows), not a second one.
            gain = f"measured {self._measured_gain(winner)}"
        after = f" ({self.retune_reason.removeprefix('re-tuning ')})" if self.retune_reason else ""
        self._set("holding", f"holding {describe(held.config)}: {gain}{after}")

    def _measured_gain(self, winner: MeasuredWindow) -> str:
        """The speed-up of a search's winner over its incumbent (autobyte.types.speedup), from their
        windows in this search's context: the figure its decision, the status and history show."""
        return self._versus_incumbent(winner.median_s)

    # ------------------------------------------------------------------ holding and drift
    def _hold(self, held: MeasuredWindow, watch_reference: list[StepMetrics]) -> None:
        self.held = held
        self.detector = DriftDetector(watch_reference, shift_scale=self._backoff())
        self.recent = list(watch_reference[-RECENT_STEPS:])
        self.next_rescore_wall_s = self.newest_wall_s + self.params.rescore_s

    def _backoff(self) -> float:
        return self.params.fruitless_backoff ** min(self.fruitless, self.params.fruitless_max)

    def _on_watch(self, m: StepMetrics) -> None:
        if self.held is not None and m.config != self.held.config:
            self.held, self.detector, self.window = None, None, []  # not what we hold: start over
        if self.detector is None:
            # Holding without a reference yet (after a decision the job did not apply): collect one.
            self.window.append(m)
            if len(self.window) >= self.window_steps:
                self._hold(
                    MeasuredWindow(m.config, list(self.window), self.decision_in_effect or 0),
                    self.window,
                )
                self.window = []
            return
        alarm = self.detector.update(m)
        if alarm is not None:
            self.stats["retunes"] += 1
            self._rebaseline(
                f"re-tuning after {alarm.reason}",
                new_segment=True,
                steps=self.params.rebaseline_steps,
            )
            return
        self.recent.append(m)
        del self.recent[:-RECENT_STEPS]
        if (
            m.wall_time_s >= self.next_rescore_wall_s
            and len(self.recent) >= self.params.min_trial_steps + 2
        ):
            self.next_rescore_wall_s = m.wall_time_s + self.params.rescore_s
            self._rescore()

    def _rescore(self) -> None:
        """A drift too gradual for the CUSUM (a slow ramp) can still make another configuration
        clearly better: every `rescore_s` the predictor (corrected by this job's measured errors)
        scores the candidates in the held configuration's current context, and a candidate
        predicted clearly faster (mean gain above twice min_gain, raised by the fruitless back-off,
        and its optimistic bound past min_gain) re-opens the search."""
        held = self.held
        assert held is not None
        context = summarize(self.recent, self.shape)
        prediction = self.evidence.corrected(
            self.predictor.predict(context, held.config, self.candidates), held.config
        )
        gate = -math.log1p(self.params.min_gain) * self._backoff()
        best = None
        for candidate, mu, sd in zip(prediction.candidates, prediction.mean, prediction.std):
            if (
                candidate != held.config
                and mu < 2 * gate
                and mu - self.params.kappa * sd < gate
                and (best is None or mu < best[1])
            ):
                best = (candidate, float(mu))
        if best is None:
            return
        self.stats["retunes"] += 1
        self._rebaseline(
            f"re-tuning: {describe(best[0])} predicted "
            f"{describe_speedup(math.exp(-best[1]), describe(held.config))} now",
            new_segment=True,
            steps=self.params.rebaseline_steps,
        )

    def _not_applied(self) -> None:
        """A decision the job never applied (a rank that ignores the daemon): stop exploring, hold
        what is in effect, and say so; drift can still re-open the search."""
        pending = self.pending
        assert pending is not None
        self.pending = None
        self.trial = None
        self.stats["not_applied"] += 1
        log.warning(
            "job %s did not apply decision #%d within %.0f s",
            self.job,
            pending.decision_id,
            self.params.apply_timeout_s,
        )
        self.window = []
        self.held = None
        self.detector = None
        self.window_steps = self._window(
            self.params.rebaseline_steps, self.params.baseline_window_s
        )
        self._set(
            "holding",
            f"holding {describe(self.config or Config())}: decision #{pending.decision_id} "
            f"was not applied by the job within {self.params.apply_timeout_s:.0f} s",
        )

    # ------------------------------------------------------------------ helpers
    def _window(self, nominal: int, seconds: float) -> int:
        """Steps in a measurement window: `nominal`, fewer when steps are so long that the window
        would last more than `seconds` (a search must end before the context moves on), never
        fewer than the sequential test needs."""
        if self.step_s <= 0:
            return nominal
        return max(self.params.min_trial_steps + 2, min(nominal, math.ceil(seconds / self.step_s)))

    def _learn_noise(self, samples: Sequence[StepMetrics]) -> None:
        """The job's step-time noise (log units): a robust spread of every measured window's
        deviations from its own median, pooled over the recent windows (a 12-step window alone
        misjudges it by +-30%)."""
        logs = [math.log(s.step_time_s) for s in samples]
        center = statistics.median(logs)
        self.residuals.extend(x - center for x in logs)
        del self.residuals[:-400]
        self.sigma = max(self.params.sigma_floor, robust_sigma(self.residuals))

    def _decide(
        self, config: Config, reason: str, predicted_s: float | None, kind: str
    ) -> int | None:
        decision = self.sink.decide(
            config, self.newest_step + self.params.apply_lead_steps, reason, predicted_s, kind
        )
        if decision is None:
            self.pause("an operator decided")
            return None
        self.own_decision_ids.add(decision)
        self.pending = PendingDecision(
            decision, config, self.newest_step + self.params.apply_lead_steps, self.newest_wall_s
        )
        return decision

    def _record(self, measured: MeasuredWindow) -> None:
        if len(measured.samples) < self.params.min_trial_steps:
            return
        context = summarize(measured.samples, self.shape)
        self.sink.record_window(
            Window(
                self.job,
                self.segment,
                measured.config,
                context,
                measured.median_s,
                len(measured.samples),
                measured.samples[-1].wall_time_s,
            )
        )

    def _set(self, phase: str, detail: str) -> None:
        changed = (phase, detail) != (self.phase, self.detail)
        self.phase, self.detail = phase, detail
        if changed:
            self.sink.publish(self.status)
