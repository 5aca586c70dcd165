"""Exploring: the trials of a search, one candidate at a time.

- a candidate is tried only when the trial pays (`paying`, tuner.verdict.trial_value), at most
  `max_trials` in a search. Before each trial the untried candidates are scored again from the best
  configuration measured so far, with the spread widened by the predictor's error on this search's
  measurements (a job the predictor does not know gets wider spreads, so fewer candidates are
  *likely* winners and each trial's expected loss grows).
- when a trial pays: the predicted log ratio X of a candidate to the best measured configuration
  is taken as Normal(mean, spread) (the ensemble's mean and spread, widened as above). From the
  costs of the search itself, not from any scenario:
  - it *wins* when X < -log(1 + min_gain) (only then does the search switch); the probability of
    that, p_win, must be at least 1/2: a trial more likely to be rolled back than kept is
    exploration the job pays for in steps, and the share of trials that measure a gain is p_win
    on average when the spread is calibrated;
  - its expected net value in steps, H x E[(1 - e^X) 1{win}] - E[(e^X - 1) n(X)] - s, must be
    positive: the gain per step of a winner over the steps H it is expected to be held, against
    the excess of the trial's own n steps (transition + window; only transition +
    min_trial_steps when the sequential test cuts it, X > log(1 + clearly_worse)) and the s = 2
    steps its two switches cost (the first step after a switch waits for the previous step's
    all-reduces without overlap: at most a step each). H is the context's expected remaining
    lifetime (TunerJob.horizon_steps: context changes taken as a memoryless process, their mean
    estimated from this job's own changes and `context_prior_s`). Of the candidates that pay, the
    one with the largest value is tried.
- the gain calibration (tuner.verdict.gain_calibration): before each further trial, the predicted
  log ratios of the untried candidates are multiplied by the slope of what this search's trials
  measured against what the model predicted for them (a prior slope of 1 that one or two trials
  can overturn). A search's first trials are the model's most optimistic predictions, so when they
  measure none of their predicted gain, the rest of the list is taken to be as optimistic and the
  search ends ("no trial beat it") instead of spending max_trials.
- a trial: switch (a decision applied a few steps ahead), discard `transition_steps`, measure up to
  `trial_steps`; Wald's sequential probability ratio test on log step times cuts a trial that is
  clearly (`clearly_worse`) slower than the best measured so far as soon as `min_trial_steps` are
  in. A trial whose context figures jumped more than a configuration explains (drift.context_jump)
  against the incumbent *and* against every configuration already measured in this search
  (`unexplained_jump`) is checked (tuner.phases.checking), unless it is faster than anything that
  context could have made the incumbent (drift.fastest_in_context) by the switch margin.
- what earlier jobs of this shape measured (tuner.evidence): combined with the model's prediction;
  where that says an earlier job's held configuration wins by more than `min_gain` at `z_switch`
  spreads, the search switches to it *without a trial* (`switch_known`, "warm start: ..."): its
  verification window keeps it when it measures at least `min_gain` over the incumbent; otherwise
  it counts as a lost trial and the search goes on. When a trial's winner is the configuration an
  earlier job held after its search in the same context (tried first when its trial pays), the
  search ends there: that search already paid for the trials from it.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence

from autobyte.types import Config, StepMetrics, describe_speedup

from autobyted.tuner.drift import Alarm, context_jump, fastest_in_context
from autobyted.tuner.features import summarize
from autobyted.tuner.grid import describe
from autobyted.tuner.job import Search, TunerJob
from autobyted.tuner.measured import MeasuredWindow
from autobyted.tuner.phases import Phase, checking, paused, verifying
from autobyted.tuner.verdict import TrialValue, clearly_worse, gain_calibration, trial_value

log = logging.getLogger(__name__)

Valued = tuple[
    Config, float, TrialValue
]  # (candidate, predicted mean log ratio, its trial's value)


def paying(
    job: TunerJob, reference: MeasuredWindow, scored: Sequence[tuple[Config, float, float]]
) -> tuple[list[Valued], Valued | None]:
    """Of (candidate, mean, spread) predicted against `reference`, the ones whose trial pays
    (trial_value), best value first; and the best of all (for the reason when none pays)."""
    params = job.params
    horizon = job.horizon_steps(reference.median_s)
    trial = params.transition_steps + job.window(params.trial_steps, params.trial_window_s)
    cut = params.transition_steps + params.min_trial_steps
    valued = sorted(
        (
            (
                c,
                mu,
                trial_value(mu, sd, horizon, trial, cut, params.min_gain, params.clearly_worse),
            )
            for c, mu, sd in scored
        ),
        key=lambda t: -t[2].value_steps,
    )
    pays = [t for t in valued if t[2].pays]
    best = max(valued, key=lambda t: t[2].win_probability, default=None)
    return pays, best


def none_pays(best: Valued | None) -> str:
    """Why a search ends without (further) trials."""
    if best is None:
        return "no candidate left to try"
    config, mu, value = best
    return (
        f"no trial is likely to win more than it costs; the likeliest, {describe(config)}, "
        f"predicted {describe_speedup(math.exp(-mu), 'the incumbent')}, "
        f"{100 * value.win_probability:.0f}% likely to win"
    )


def next_trial(job: TunerJob, search: Search) -> Phase:
    """Score every untried candidate from the best configuration measured so far (the predictor
    is relative, and a near reference predicts best), widen the predictor's spread by its
    measured error on this search (the configurations already measured, predicted from the same
    reference: a job unlike anything the predictor knows shows large errors and gets explored),
    and try the candidate whose trial pays best; the search's end (verifying.finish) when none
    pays or none is left."""
    params, incumbent = job.params, job.incumbent
    assert incumbent is not None
    measured = [incumbent] + [t for t in search.trials if not t.cut]
    reference = min(measured, key=lambda t: t.log_median)
    tried = {t.config for t in search.trials} | {incumbent.config}
    untried = [c for c in job.candidates if c not in tried]
    if not untried or len(search.trials) >= params.max_trials:
        return verifying.finish(job, search, "")
    if reference is not incumbent and job.evidence.held_before(reference):
        # An earlier job of this shape searched this context and held this configuration:
        # what it tried from here is in its windows, and this job measured the same winner.
        return verifying.finish(job, search, "")
    context = summarize(reference.samples, job.shape)
    others = [t for t in measured + [t for t in search.trials if t.cut] if t is not reference]
    prediction = job.evidence.corrected(
        job.predictor.predict(context, reference.config, untried + [t.config for t in others]),
        reference.config,
    )
    prediction = job.evidence.with_known(
        prediction, reference, [incumbent, *search.trials], job.sigma, len(untried)
    )
    slope = gain_calibration(
        [
            (t.model_log, t.log_median - t.reference_log)
            for t in search.trials
            if t.model_log is not None
        ],
        params.gain_slope_prior_sd,
        params.gain_error_sd,
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
    pays, best = paying(job, reference, scored)
    if not pays:
        return verifying.finish(job, search, "" if search.trials else none_pays(best))
    # What an earlier search in this context ended holding is tried first (its measurement is
    # the surest gain; if it wins again, that search's trials from it need not be repeated).
    config, mu, _value = next((t for t in pays if t[0] in job.evidence.known_winners), pays[0])
    predicted = reference.median_s * math.exp(mu)
    spread = next(sd for c, _mu, sd in scored if c == config)
    if (
        config in job.evidence.known_winners
        and not search.trials
        and reference is incumbent
        and mu + params.z_switch * spread < -math.log1p(params.min_gain)
    ):
        return switch_known(job, search, config, predicted)
    number = len(search.trials) + 1
    search.trials_planned = max(search.trials_planned, number)
    reason = (
        f"trial {number}/{search.trials_planned}: {describe(config)} predicted "
        f"{job.versus_incumbent(predicted)}{search.context_note()}"
    )
    decision = job.decide(config, reason, predicted, "trial")
    if decision is None:
        return paused.enter(job)
    trial = MeasuredWindow(
        config,
        [],
        decision,
        math.log(predicted) - incumbent.log_median,
        model_log=uncalibrated[config],
        reference_log=reference.log_median,
    )
    prefix = f"{search.retune_reason}: " if search.retune_reason else ""
    job.set("exploring", f"{prefix}exploring {number}/{search.trials_planned} {describe(config)}")
    return Exploring(job, search, trial)


def switch_known(job: TunerJob, search: Search, config: Config, predicted: float) -> Phase:
    """Warm start: an earlier job of this shape held `config` after its search in this context,
    and what it measured (with the model) says it wins by more than min_gain at z_switch
    standard errors: switch to it without a trial; its verification window decides (kept when
    it measures at least min_gain over the incumbent, else it counts as a lost trial and the
    search goes on)."""
    incumbent = job.incumbent
    assert incumbent is not None
    reason = (
        f"warm start: {describe(config)}, held by an earlier job of this model in this context, "
        f"predicted {job.versus_incumbent(predicted)}{search.context_note()}; switching without a trial"
    )
    decision = job.decide(config, reason, predicted, "switch")
    if decision is None:
        return paused.enter(job)
    winner = MeasuredWindow(config, [], decision, math.log(predicted) - incumbent.log_median)
    search.confirmed = True
    job.stats["switches"] += 1
    search.window_steps = job.window(job.params.trial_steps, job.params.trial_window_s)
    job.set(
        "verifying",
        f"switching to {describe(config)} (an earlier job's winner here), verifying",
    )
    return verifying.Verifying(job, search, winner, decision)


def unexplained_jump(
    incumbent: MeasuredWindow, trials: Sequence[MeasuredWindow], trial: MeasuredWindow
) -> Alarm | None:
    """The trial's context jump against the incumbent (drift.context_jump), unless the trial's
    context figures agree with those of another configuration measured in this search: then the
    jump is what configurations do to the figures, not the context moving (a 64 KiB partition's
    bandwidth estimate against a 4 MiB one's)."""
    jump = context_jump(incumbent.samples, trial.samples)
    if jump is None or any(context_jump(other.samples, trial.samples) is None for other in trials):
        return None
    return jump


def accept_trial(job: TunerJob, search: Search, trial: MeasuredWindow) -> Phase:
    """A trial's measurement counts: learn from it and go on to the next trial."""
    assert job.incumbent is not None
    # What the predictor got wrong about this configuration, for this job (kept across
    # segments: a bias of the model for this job and machine outlives a context change).
    # Committed when the search ends cleanly, or when what interrupted it was a jump of the
    # context large enough to show in a trial's own context check (baseline.abort); not when the
    # context moved under the search more gently (a ramp is no evidence); clipped.
    error = (trial.log_median - job.incumbent.log_median) - trial.predicted_log
    job.evidence.add_search_error(trial.config, error)
    job.learn_noise(trial.samples)
    search.trials.append(trial)
    job.stats["cut"] += trial.cut
    job.record(trial)
    return next_trial(job, search)


class Exploring(Phase):
    """One trial's window: cut early when clearly worse, then checked, accepted or both."""

    def __init__(self, job: TunerJob, search: Search, trial: MeasuredWindow) -> None:
        super().__init__(job)
        self.search, self.trial = search, trial

    def on_sample(self, m: StepMetrics) -> Phase:
        job, search, trial, params = self.job, self.search, self.trial, self.job.params
        trial.samples.append(m)
        n = len(trial.samples)
        length = job.window(params.trial_steps, params.trial_window_s)
        if n >= params.min_trial_steps and n < length and self._clearly_worse():
            trial.cut = True
        if not trial.cut and n < length:
            return self
        incumbent = job.incumbent
        assert incumbent is not None
        jump = unexplained_jump(incumbent, search.trials, trial)
        job.stats["trials"] += 1
        job.sink.close_decision(
            trial.decision_id, trial.median_s, "rolled_back" if trial.cut else None
        )
        # A check costs its window at the incumbent's step time (3x the trial's from a poor
        # start), and it can change the answer only when the context the trial ran in could have
        # made the incumbent as fast as the trial (drift.fastest_in_context): a trial faster than
        # that bound by the switch margin wins whatever the measured context did, and goes on
        # unchecked (the search's end still measures the incumbent again: confirm).
        fastest = fastest_in_context(incumbent.samples, trial.samples)
        if jump is not None and not trial.cut and trial.median_s * (1 + params.min_gain) < fastest:
            log.debug(
                "%s: %s during trial %d cannot explain its %.0f ms (the incumbent at best %.0f ms): no check",
                job.job,
                jump.reason,
                len(search.trials) + 1,
                trial.median_s * 1e3,
                fastest * 1e3,
            )
            jump = None
        if jump is not None and (jump.signal, jump.direction) not in search.cleared:
            # A jump no configuration explains: did the context move while the trial ran? Measure
            # the incumbent again before trusting the comparison.
            check_steps = job.window(params.rebaseline_steps, params.baseline_window_s)
            reason = (
                f"check: {jump.reason} during trial {len(search.trials) + 1}? it could explain the "
                f"trial's {trial.median_s * 1e3:.0f} ms (the incumbent at best {fastest * 1e3:.0f} ms): "
                f"measuring {describe(incumbent.config)} again, ~{check_steps} steps"
            )
            decision = job.decide(incumbent.config, reason, incumbent.median_s, "check")
            if decision is None:
                return paused.enter(job)
            search.window_steps = job.window(params.rebaseline_steps, params.baseline_window_s)
            job.set("checking", f"checking whether the context changed ({jump.reason}?)")
            return checking.Checking(job, search, trial, jump, decision)
        return accept_trial(job, search, trial)

    def _clearly_worse(self) -> bool:
        """Wald's SPRT on log step times against the best configuration measured in this search
        (the incumbent until a trial beats it): H0 mean = its log median, H1 = that +
        log(1 + clearly_worse), sigma = the job's pooled noise; True when H1 is accepted."""
        job = self.job
        assert job.incumbent is not None
        best = min(
            [job.incumbent.log_median] + [t.log_median for t in self.search.trials if not t.cut]
        )
        return clearly_worse(
            (s.step_time_s for s in self.trial.samples), best, job.sigma, job.params
        )
