"""The graph of one job's search: every transition between the phases (tuner.phases), in one place.

A phase returns what it asks for (tuner.actions); `apply` acts on it. Only here are decisions
issued (`_switch`: a decision the sink refuses pauses the job, once, for every transition), the
status named (`STATES`, the one table of what `autobyte status` shows), what the job and its search
remember written, and the next phase built.

Trials (`next_trial`):
- a candidate is tried only when the trial pays (tuner.verdict.paying / trial_value), at most
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
- what earlier jobs of this shape measured (tuner.evidence): combined with the model's prediction;
  where that says an earlier job's held configuration wins by more than `min_gain` at `z_switch`
  spreads, the search switches to it *without a trial* (`switch_known`, "warm start: ..."): its
  verification window keeps it when it measures at least `min_gain` over the incumbent; otherwise
  it counts as a lost trial and the search goes on. When a trial's winner is the configuration an
  earlier job held after its search in the same context (tried first when its trial pays), the
  search ends there: that search already paid for the trials from it.
- what earlier jobs of this model held at another rank count (tuner.evidence's `carried`, the job
  restarted at another size): the job's first baseline ends early (min_trial_steps + 2 steps) and
  that configuration is the first trial, whatever the model predicts ("trial 1/N: ..., held by
  JOB at 8 ranks, ..."); a trial like any other (cut when clearly worse, confirmed before a
  switch), never a switch without one: the best configuration moves with the rank count.

The end of a search (`finish`, `settle`):
- the best measured configuration wins only if it beats the incumbent by more than `min_gain` and
  by `z_switch` standard errors (hysteresis); otherwise the incumbent stays. A winner no check of
  the incumbent followed is confirmed first (tuner.phases.checking), then switched to and verified
  (tuner.phases.verifying).
- `settle`: hold the result and say what the search found. The first time, when the incumbent is
  the job's starting configuration, that is "no headroom" and the job is told so.
- `abort`: the context moved while a search ran: search again in the new context; when that keeps
  happening (`max_aborts` in a row), hold what is in effect and let the drift detector, with a
  raised bar, decide when to look again.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence

from autobyte.types import Config, StepMetrics, describe_speedup

from autobyted.tuner import actions as act
from autobyted.tuner.drift import JUMP_LIMITS
from autobyted.tuner.features import summarize
from autobyted.tuner.grid import describe
from autobyted.tuner.job import Search, TunerJob
from autobyted.tuner.measured import MeasuredWindow, PendingDecision
from autobyted.tuner.phases import Phase
from autobyted.tuner.phases.baseline import Baseline
from autobyted.tuner.phases.checking import Checking, Confirming
from autobyted.tuner.phases.exploring import Exploring
from autobyted.tuner.phases.paused import Paused
from autobyted.tuner.phases.verifying import Verifying
from autobyted.tuner.phases.watching import Watching
from autobyted.tuner.predictor import Prediction
from autobyted.tuner.stragglers import LINK_STEPS, where
from autobyted.tuner.verdict import Valued, beats, gain_calibration, none_pays, paying

log = logging.getLogger(__name__)

# What `autobyte status` shows as a job's state, and when; set here only (`_status`).
STATES = {
    "warm-up": "the first steps, ignored",
    "baseline": "measuring the starting configuration",
    "re-tuning": "measuring the configuration in effect in a new context",
    "exploring": "a trial of a candidate",
    "checking": "the incumbent again: did the context move during a trial?",
    "confirming": "the incumbent again before switching to the search's winner",
    "verifying": "the winner (or the incumbent after a rollback) after the switch",
    "holding": "the search's result, watched for drift",
    "no headroom": "nothing beat what is in effect, watched for drift",
    "observing": "observe mode: a recommendation, never applied",
    "paused": "an operator's decision or pause",
}


def _status(job: TunerJob, state: str, detail: str) -> None:
    assert state in STATES, state
    job.set(state, detail)


def apply(job: TunerJob, action: act.Action, phase: Phase) -> Phase:
    """The phase the next sample goes to, after acting on what `phase` asked for."""
    while True:
        if isinstance(action, act.Stay):
            return phase
        if isinstance(action, act.Open):
            phase = open_search(
                job, action.reason, action.new_segment, action.steps, action.retune, action.seed
            )
            if action.sample is None:
                return phase
            action = phase.on_sample(action.sample)
            continue
        return _ACT[type(action)](job, action)


def _switch(
    job: TunerJob,
    config: Config,
    reason: str,
    predicted_s: float | None,
    kind: str,
    status: tuple[str, str],
    build: Callable[[int], Phase],
    granted: Callable[[], None] = lambda: None,
) -> Phase:
    """Issue a decision; refused (an operator's pause), the job is paused; granted, `granted`
    runs, the status is set and `build` makes the phase that measures the decision."""
    decision = job.decide(config, reason, predicted_s, kind)
    if decision is None:
        return pause(job)
    granted()
    _status(job, *status)
    return build(decision)


def pause(job: TunerJob, why: str = "an operator decided") -> Paused:
    """Pause: forget the decision in flight and say how to hand the job back."""
    job.paused = True
    job.pending = None
    _status(job, "paused", f"paused: {why}; `autobyte tune {job.job} --resume` hands it back")
    return Paused(job)


def resume(job: TunerJob) -> Phase:
    """An operator hands the job back: its configuration is the new starting point."""
    job.paused = False
    job.searched_once = False
    job.starting = None
    return open_search(
        job, "resumed after an operator's pause", new_segment=True, steps=job.params.baseline_steps
    )


# -- the start of a search ------------------------------------------------------------------------


def open_search(
    job: TunerJob,
    reason: str,
    new_segment: bool,
    steps: int,
    retune: bool = False,
    seed: Sequence[StepMetrics] = (),
) -> Baseline:
    """Open a search: a new context segment (unless it is the job's first), a baseline of `steps`
    (fewer for long steps) that starts with `seed` (steps of the configuration in effect already
    in the new context: a drift alarm's), and nothing held until the search settles."""
    if retune:
        job.stats["retunes"] += 1
    if new_segment:
        job.segment += 1
    job.search = Search(reason, job.window(steps, job.params.baseline_window_s))
    job.held = None  # what is measured from now on is the new context's incumbent
    state = "re-tuning" if reason else "baseline"
    prefix = f"{reason}: " if reason else ""
    # Before the job's next step the tuner may not know what is in effect (a tuner opened on a
    # running job reads from its newest step): say so rather than print none/inf.
    in_effect = describe(job.config) if job.config is not None else "the configuration in effect"
    _status(job, state, f"{prefix}measuring {in_effect}")
    return Baseline(job, job.search, seed)


def _adopt(job: TunerJob, incumbent: MeasuredWindow) -> None:
    """The baseline's window becomes the search's incumbent."""
    job.incumbent = incumbent
    if job.starting is None:
        job.starting = incumbent
    job.learn_noise(incumbent.samples)
    job.record(incumbent)
    job.evidence.open_search(incumbent.config)


def _set_plan(
    job: TunerJob,
    incumbent: MeasuredWindow,
    candidates: tuple[Config, ...],
    prediction: Prediction,
) -> None:
    job.candidates = candidates
    job.best_predicted_s = min(
        prediction.step_time_s(incumbent.median_s, i) for i in range(len(candidates))
    )


def baseline_measured(job: TunerJob, action: act.BaselineMeasured) -> Phase:
    """The plan of the search from its baseline: observe mode recommends; otherwise the trials
    that pay, or the search's end at once when none does."""
    search, incumbent, params = action.search, action.incumbent, job.params
    _adopt(job, incumbent)
    candidates, prediction = job.plan(incumbent, search.trials, job.sigma)
    if action.carried is not None:
        search.carried = action.carried
        if action.carried.config not in candidates:
            candidates, prediction = job.plan(
                incumbent, search.trials, job.sigma, extra=(action.carried.config,)
            )
    _set_plan(job, incumbent, candidates, prediction)
    gate = -math.log1p(params.min_gain)
    if job.mode == "observe":
        return recommend(job, search, prediction, incumbent, gate)
    pays, best = _paying(
        job,
        incumbent,
        [
            (c, float(mu), float(sd))
            for c, mu, sd in zip(prediction.candidates, prediction.mean, prediction.std)
            if c != incumbent.config
        ],
    )
    search.trials_planned = min(params.max_trials, len(pays))
    if not pays and search.carried is None:
        return finish(job, search, none_pays(best))
    return next_trial(job, search)


def warm_start(job: TunerJob, action: act.WarmStart) -> Phase:
    _adopt(job, action.incumbent)
    _set_plan(job, action.incumbent, action.candidates, action.prediction)
    return switch_known(job, action.search, action.config, action.predicted_s)


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
    phase = hold(job, incumbent, incumbent.samples, search.window_steps)
    if not confident:
        _status(
            job,
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
    _status(
        job,
        "observing",
        f"observe: recommends {describe(best)} (predicted "
        f"{describe_speedup(math.exp(-mu), describe(incumbent.config))})",
    )
    return phase


# -- trials ---------------------------------------------------------------------------------------


def _paying(
    job: TunerJob, reference: MeasuredWindow, scored: list[tuple[Config, float, float]]
) -> tuple[list[Valued], Valued | None]:
    params = job.params
    return paying(
        scored,
        job.horizon_steps(reference.median_s),
        params.transition_steps + job.window(params.trial_steps, params.trial_window_s),
        params.transition_steps + params.min_trial_steps,
        params,
    )


def next_trial(job: TunerJob, search: Search) -> Phase:
    """Score every untried candidate from the best configuration measured so far (the predictor
    is relative, and a near reference predicts best), widen the predictor's spread by its
    measured error on this search (the configurations already measured, predicted from the same
    reference: a job unlike anything the predictor knows shows large errors and gets explored),
    and try the candidate whose trial pays best; the search's end (`finish`) when none pays or
    none is left."""
    params, incumbent = job.params, job.incumbent
    assert incumbent is not None
    measured = [incumbent] + [t for t in search.trials if not t.cut]
    reference = min(measured, key=lambda t: t.log_median)
    tried = {t.config for t in search.trials} | {incumbent.config}
    untried = [c for c in job.candidates if c not in tried]
    if not untried or len(search.trials) >= params.max_trials:
        return finish(job, search, "")
    if reference is not incumbent and job.evidence.held_before(reference):
        # An earlier job of this shape searched this context and held this configuration:
        # what it tried from here is in its windows, and this job measured the same winner.
        return finish(job, search, "")
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
    pays, best = _paying(job, reference, scored)
    carried = search.carried if not search.trials else None
    if carried is not None and carried.config in untried:
        # What this model held at another rank count: tried first, whatever the model predicts
        # (a clearly worse trial is cut after a few steps).
        config, mu = carried.config, next(mu for c, mu, _sd in scored if c == carried.config)
        held = f", held by {carried.job} at {carried.world_size} ranks,"
    elif not pays:
        return finish(job, search, "" if search.trials else none_pays(best))
    else:
        # What an earlier search in this context ended holding is tried first (its measurement
        # is the surest gain; if it wins again, that search's trials from it need not be
        # repeated).
        config, mu, _value = next((t for t in pays if t[0] in job.evidence.known_winners), pays[0])
        held = ""
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
        f"trial {number}/{search.trials_planned}: {describe(config)}{held} predicted "
        f"{job.versus_incumbent(predicted)}{search.context_note()}"
    )
    prefix = f"{search.retune_reason}: " if search.retune_reason else ""

    def measure(decision: int) -> Phase:
        trial = MeasuredWindow(
            config,
            [],
            decision,
            math.log(predicted) - incumbent.log_median,
            model_log=uncalibrated[config],
            reference_log=reference.log_median,
        )
        return Exploring(job, search, trial)

    return _switch(
        job,
        config,
        reason,
        predicted,
        "trial",
        ("exploring", f"{prefix}exploring {number}/{search.trials_planned} {describe(config)}"),
        measure,
    )


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

    def granted() -> None:
        search.confirmed = True
        job.stats["switches"] += 1
        search.window_steps = job.window(job.params.trial_steps, job.params.trial_window_s)

    def verify(decision: int) -> Phase:
        winner = MeasuredWindow(config, [], decision, math.log(predicted) - incumbent.log_median)
        return Verifying(job, search, winner, decision)

    return _switch(
        job,
        config,
        reason,
        predicted,
        "switch",
        ("verifying", f"switching to {describe(config)} (an earlier job's winner here), verifying"),
        verify,
        granted,
    )


def accept(job: TunerJob, action: act.Accept) -> Phase:
    """A trial's measurement counts: learn from it and go on to the next trial."""
    search, trial = action.search, action.trial
    search.checked.extend(action.checked)
    if action.cleared is not None:
        search.cleared.add(action.cleared)
    assert job.incumbent is not None
    # What the predictor got wrong about this configuration, for this job (kept across
    # segments: a bias of the model for this job and machine outlives a context change).
    # Committed when the search ends cleanly, or when what interrupted it was a jump of the
    # context large enough to show in a trial's own context check (`abort`); not when the
    # context moved under the search more gently (a ramp is no evidence); clipped.
    error = (trial.log_median - math.log(trial.against(job.incumbent))) - trial.predicted_log
    job.evidence.add_search_error(trial.config, error)
    job.learn_noise(trial.samples)
    search.trials.append(trial)
    job.stats["cut"] += trial.cut
    job.record(trial)
    return next_trial(job, search)


def check(job: TunerJob, action: act.Check) -> Phase:
    """A trial's context jumped more than any configuration explains: did the context move while
    the trial ran? Measure the incumbent again before trusting the comparison."""
    search, trial, jump, params = action.search, action.trial, action.jump, job.params
    incumbent = job.incumbent
    assert incumbent is not None
    check_steps = job.window(params.rebaseline_steps, params.baseline_window_s)
    link = where(jump.signal, jump.direction, trial.samples[-LINK_STEPS:])
    reason = (
        f"check: {jump.reason}{link} during trial {len(search.trials) + 1}? it could explain the "
        f"trial's {trial.median_s * 1e3:.0f} ms (the incumbent at best {action.fastest_s * 1e3:.0f} ms): "
        f"measuring {describe(incumbent.config)} again, ~{check_steps} steps"
    )
    return _remeasure(
        job,
        search,
        reason,
        ("checking", f"checking whether the context changed ({jump.reason}?)"),
        lambda decision: Checking(job, search, trial, jump, decision),
    )


def _remeasure(
    job: TunerJob,
    search: Search,
    reason: str,
    status: tuple[str, str],
    build: Callable[[int], Phase],
) -> Phase:
    """Measure the incumbent again (a check of a trial, a confirm of the search's winner)."""
    params, incumbent = job.params, job.incumbent
    assert incumbent is not None

    def granted() -> None:
        search.window_steps = job.window(params.rebaseline_steps, params.baseline_window_s)

    return _switch(
        job, incumbent.config, reason, incumbent.median_s, "check", status, build, granted
    )


# -- the end of a search --------------------------------------------------------------------------


def finish(job: TunerJob, search: Search, why: str) -> Phase:
    """End of a search: pick the winner (hysteresis), confirm it, switch to it if needed, verify."""
    params, incumbent = job.params, job.incumbent
    assert incumbent is not None
    winner = incumbent
    for trial in search.trials:
        if trial.cut:
            continue
        if (
            beats(
                trial.log_median,
                len(trial.samples),
                incumbent.log_median,
                len(incumbent.samples),
                job.sigma,
                params,
            )
            and trial.log_median < winner.log_median
        ):
            winner = trial
    # A re-tune that ends where it started was not worth it: raise the bar for the next one (the
    # host's own ups and downs, e.g. a neighbour's load on a shared machine); a re-tune that
    # switched resets it.
    if search.retune_reason:
        job.fruitless = job.fruitless + 1 if winner is incumbent else 0
    if (
        winner is not incumbent
        and not search.confirmed
        and not any(t is winner for t in search.checked)
    ):
        # Before trusting a comparison made over a whole search, measure the incumbent again.
        check_steps = job.window(params.rebaseline_steps, params.baseline_window_s)
        reason = (
            f"confirm: measuring {describe(incumbent.config)} again before switching to "
            f"{describe(winner.config)} (~{check_steps} steps, {params.min_trial_steps} when the winner "
            f"beats both measurements){search.context_note()}"
        )
        return _remeasure(
            job,
            search,
            reason,
            (
                "confirming",
                (
                    f"measuring {describe(incumbent.config)} again before switching to "
                    f"{describe(winner.config)}"
                ),
            ),
            lambda decision: Confirming(job, search, winner, decision),
        )
    if winner.config == job.config:
        # Already in effect (nothing was tried, or it is the incumbent): its window is the proof.
        return settle(job, search, winner, winner.samples, why)
    returning = winner is incumbent
    reason = (
        f"return to {describe(winner.config)}: no trial beat it{search.context_note()}"
        if returning
        else f"hold best: {describe(winner.config)} measured "
        f"{job.versus_incumbent(winner.median_s, winner)}"
        f"{search.context_note()}"
    )

    def granted() -> None:
        job.stats["switches"] += not returning
        search.window_steps = job.window(params.rebaseline_steps, params.baseline_window_s)

    return _switch(
        job,
        winner.config,
        reason,
        winner.median_s,
        "return" if returning else "switch",
        ("verifying", f"switching to {describe(winner.config)}, verifying"),
        lambda decision: Verifying(job, search, winner, decision),
        granted,
    )


def confirmed(job: TunerJob, action: act.Finish) -> Phase:
    if action.confirmed:
        action.search.confirmed = True
    return finish(job, action.search, action.why)


def verified(job: TunerJob, action: act.Verified) -> Phase:
    """The winner's verification window kept it."""
    winner, measured = action.winner, action.measured
    if not winner.samples and winner is not job.incumbent:  # a warm start's switch
        winner.samples.extend(measured.samples)
    job.record(measured)
    return settle(job, action.search, winner, measured.samples, "")


def warm_start_lost(job: TunerJob, action: act.WarmStartLost) -> Phase:
    """A warm start's switch did not win here: a lost trial; the search goes on from the
    incumbent."""
    job.stats["trials"] += 1
    action.search.confirmed = False
    return accept(job, act.Accept(action.search, action.measured))


def roll_back(job: TunerJob, action: act.RollBack) -> Phase:
    """The winner measured slower than the incumbent beyond the noise: back to the incumbent,
    verified in its turn."""
    search, winner, measured = action.search, action.winner, action.measured
    incumbent = job.incumbent
    assert incumbent is not None
    job.stats["rollbacks"] += 1
    job.sink.close_decision(measured.decision_id, measured.median_s, "rolled_back")
    reason = (
        f"rollback: {describe(winner.config)} measured {measured.median_s * 1e3:.1f} ms, "
        f"{describe(incumbent.config)} {incumbent.median_s * 1e3:.1f} ms"
    )
    return _switch(
        job,
        incumbent.config,
        reason,
        incumbent.median_s,
        "rollback",
        ("verifying", f"rolled back to {describe(incumbent.config)}, verifying"),
        lambda decision: Verifying(job, search, incumbent, decision),
    )


def settle(
    job: TunerJob, search: Search, winner: MeasuredWindow, reference: list[StepMetrics], why: str
) -> Phase:
    """Hold the search's result (watching) and say what it found."""
    job.aborts = 0
    job.evidence.keep_search_errors()
    first = not job.searched_once
    job.searched_once = True
    starting = job.starting
    assert starting is not None
    phase = hold(
        job,
        MeasuredWindow(winner.config, list(reference), winner.decision_id),
        reference,
        search.window_steps,
    )
    held_context = summarize(reference, job.shape)
    prediction = job.predictor.predict(held_context, winner.config, job.candidates)
    job.best_predicted_s = min(
        prediction.step_time_s(statistics.median(s.step_time_s for s in reference), i)
        for i in range(len(job.candidates))
    )
    if winner.config == starting.config and first:
        note = f" ({why})" if why else ""
        tried = (
            f"nothing beat the starting configuration {describe(starting.config)}"
            if search.trials
            else f"the starting configuration {describe(starting.config)} stays, no trial made"
        )
        _status(job, "no headroom", f"no headroom: {tried}{note}")
        return phase
    held, incumbent = job.held, job.incumbent
    assert held is not None and incumbent is not None
    if held.config == incumbent.config and search.retune_reason:
        # A new context in which nothing is worth switching to: say so, and why, at once.
        reason = search.retune_reason
        head = (
            f"no headroom after {reason.removeprefix('re-tuning after ')}"
            if reason.startswith("re-tuning after ")
            else f"no headroom ({reason})"
        )
        _status(
            job,
            "no headroom",
            f"{head}: {describe(held.config)} stays{f' ({why})' if why else ': no trial beat it'}",
        )
        return phase
    if held.config == incumbent.config:
        gain = "no candidate beat it"
    else:
        # The figure of the decision that switched (the same two windows), not a second one.
        gain = f"measured {job.versus_incumbent(winner.median_s, winner)}"
    after = f" ({search.retune_reason.removeprefix('re-tuning ')})" if search.retune_reason else ""
    _status(job, "holding", f"holding {describe(held.config)}: {gain}{after}")
    return phase


def abort(job: TunerJob, action: act.Abort) -> Phase:
    """The context moved while a search ran: search again in the new context; but when that
    keeps happening (the context changes faster than a search completes), hold what is in
    effect and let the drift detector, with a raised bar, decide when to look again."""
    search, moved, in_effect = action.search, action.moved, action.in_effect
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
        return open_search(
            job,
            f"re-tuning after {moved.reason}"
            f"{where(moved.signal, moved.direction, in_effect.samples[-LINK_STEPS:])}, during the search",
            new_segment=True,
            steps=job.params.rebaseline_steps,
        )
    phase = hold(job, in_effect, in_effect.samples, search.window_steps)
    _status(
        job,
        "holding",
        f"holding {describe(in_effect.config)}: the context changes faster than a "
        f"search completes ({moved.reason})",
    )
    return phase


# -- holding --------------------------------------------------------------------------------------


def hold(
    job: TunerJob, held: MeasuredWindow, reference: list[StepMetrics], window_steps: int
) -> Watching:
    """Hold `held`, watched against `reference`; `window_steps` is the window a new reference
    takes if the configuration in effect changes under it."""
    phase = Watching(job, window_steps)
    phase.watch(held, reference)
    return phase


def not_applied(job: TunerJob, pending: PendingDecision) -> Watching:
    """A decision the job never applied (a rank that ignores the daemon): stop exploring, hold
    what is in effect, and say so; drift can still re-open the search."""
    job.pending = None
    job.stats["not_applied"] += 1
    log.warning(
        "job %s did not apply decision #%d within %.0f s",
        job.job,
        pending.decision_id,
        job.params.apply_timeout_s,
    )
    job.held = None
    phase = Watching(job, job.window(job.params.rebaseline_steps, job.params.baseline_window_s))
    _status(
        job,
        "holding",
        f"holding {describe(job.config or Config())}: decision #{pending.decision_id} "
        f"was not applied by the job within {job.params.apply_timeout_s:.0f} s",
    )
    return phase


_ACT: dict[type, Callable[[TunerJob, act.Action], Phase]] = {
    act.BaselineMeasured: baseline_measured,
    act.WarmStart: warm_start,
    act.Accept: accept,
    act.Check: check,
    act.Finish: confirmed,
    act.Verified: verified,
    act.WarmStartLost: warm_start_lost,
    act.RollBack: roll_back,
    act.Abort: abort,
}
