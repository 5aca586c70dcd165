"""The end of a search: the winner, the switch to it, its verification, and what the job is told.

- `finish`: the best measured configuration wins only if it beats the incumbent by more than
  `min_gain` and by `z_switch` standard errors (hysteresis); otherwise the incumbent stays. A
  winner no check of the incumbent followed is confirmed first (tuner.phases.checking).
- verifying: after switching to the winner, one window checks it: if the context moved meanwhile
  (drift.window_shift), re-tune (baseline.abort); if it is slower than the incumbent beyond the
  noise, roll back. A warm start's switch (exploring.switch_known) is kept when its window
  measures at least `min_gain` over the incumbent, else it counts as a lost trial.
- `settle`: hold the result and say what the search found. The first time, when the incumbent is
  the job's starting configuration, that is "no headroom" and the job is told so.
"""

from __future__ import annotations

import math
import statistics

from autobyte.types import StepMetrics

from autobyted.tuner.drift import window_shift
from autobyted.tuner.features import summarize
from autobyted.tuner.grid import describe
from autobyted.tuner.job import Search, TunerJob
from autobyted.tuner.measured import MeasuredWindow
from autobyted.tuner.phases import Phase, baseline, checking, exploring, paused, watching
from autobyted.tuner.verdict import beats, rolls_back


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
        decision = job.decide(incumbent.config, reason, incumbent.median_s, "check")
        if decision is None:
            return paused.enter(job)
        search.window_steps = job.window(params.rebaseline_steps, params.baseline_window_s)
        job.set(
            "confirming",
            f"measuring {describe(incumbent.config)} again before switching to "
            f"{describe(winner.config)}",
        )
        return checking.Confirming(job, search, winner, decision)
    if winner.config == job.config:
        # Already in effect (nothing was tried, or it is the incumbent): its window is the proof.
        return settle(job, search, winner, winner.samples, why)
    returning = winner is incumbent
    reason = (
        f"return to {describe(winner.config)}: no trial beat it{search.context_note()}"
        if returning
        else f"hold best: {describe(winner.config)} measured {job.versus_incumbent(winner.median_s)}"
        f"{search.context_note()}"
    )
    decision = job.decide(
        winner.config, reason, winner.median_s, "return" if returning else "switch"
    )
    if decision is None:
        return paused.enter(job)
    job.stats["switches"] += not returning
    search.window_steps = job.window(params.rebaseline_steps, params.baseline_window_s)
    job.set("verifying", f"switching to {describe(winner.config)}, verifying")
    return Verifying(job, search, winner, decision)


class Verifying(Phase):
    """The winner's window after the switch: kept, rolled back, or the search re-opened."""

    def __init__(
        self, job: TunerJob, search: Search, winner: MeasuredWindow, decision_id: int
    ) -> None:
        super().__init__(job)
        self.search, self.winner, self.decision_id = search, winner, decision_id
        self.window: list[StepMetrics] = []

    def on_sample(self, m: StepMetrics) -> Phase:
        job, search, params = self.job, self.search, self.job.params
        self.window.append(m)
        if len(self.window) < search.window_steps:
            return self
        winner, incumbent = self.winner, job.incumbent
        assert incumbent is not None
        measured = MeasuredWindow(winner.config, list(self.window), self.decision_id)
        job.learn_noise(measured.samples)
        job.sink.close_decision(self.decision_id, measured.median_s, None)
        if not winner.samples and winner is not incumbent:  # a warm start's switch
            if incumbent.log_median - measured.log_median >= math.log1p(params.min_gain):
                winner.samples.extend(measured.samples)
                job.record(measured)
                return settle(job, search, winner, measured.samples, "")
            # It did not win here: a lost trial; the search goes on from the incumbent.
            job.stats["trials"] += 1
            search.confirmed = False
            measured.predicted_log = winner.predicted_log
            return exploring.accept_trial(job, search, measured)
        shift = window_shift(winner.samples, measured.samples)
        if shift is not None:
            return baseline.abort(job, search, shift, measured)
        if winner is not incumbent and rolls_back(
            measured.log_median,
            len(measured.samples),
            incumbent.log_median,
            len(incumbent.samples),
            job.sigma,
            params,
        ):
            job.stats["rollbacks"] += 1
            job.sink.close_decision(self.decision_id, measured.median_s, "rolled_back")
            reason = (
                f"rollback: {describe(winner.config)} measured {measured.median_s * 1e3:.1f} ms, "
                f"{describe(incumbent.config)} {incumbent.median_s * 1e3:.1f} ms"
            )
            decision = job.decide(incumbent.config, reason, incumbent.median_s, "rollback")
            if decision is None:
                return paused.enter(job)
            job.set("verifying", f"rolled back to {describe(incumbent.config)}, verifying")
            return Verifying(job, search, incumbent, decision)
        job.record(measured)
        return settle(job, search, winner, measured.samples, "")


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
    phase = watching.hold(
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
        job.set("no headroom", f"no headroom: {tried}{note}")
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
        job.set(
            "no headroom",
            f"{head}: {describe(held.config)} stays{f' ({why})' if why else ': no trial beat it'}",
        )
        return phase
    if held.config == incumbent.config:
        gain = "no candidate beat it"
    else:
        # The figure of the decision that switched (the same two windows), not a second one.
        gain = f"measured {job.versus_incumbent(winner.median_s)}"
    after = f" ({search.retune_reason.removeprefix('re-tuning ')})" if search.retune_reason else ""
    job.set("holding", f"holding {describe(held.config)}: {gain}{after}")
    return phase
