"""Exploring: one trial's window (which candidate is tried, and when a trial pays, is
tuner.transitions' `next_trial`, its arithmetic tuner.verdict).

- a trial: switch (a decision applied a few steps ahead), discard `transition_steps`, measure up to
  `trial_steps`; Wald's sequential probability ratio test on log step times cuts a trial that is
  clearly (`clearly_worse`) slower than the best measured so far as soon as `min_trial_steps` are
  in. A trial whose context figures jumped more than a configuration explains (drift.context_jump)
  against the incumbent *and* against every configuration already measured in this search
  (verdict.unexplained_jump) is checked (tuner.phases.checking), unless it is faster than anything
  that context could have made the incumbent (drift.fastest_in_context) by the switch margin.
- A trial that would lead the search (faster than everything measured in it by the switch margin)
  is checked too when a smaller move of its context in its favour (drift.favourable_move: a link
  faster, compute or others' load lighter, beyond the noise) could explain its gain: a pulse of
  the context (a rate swinging 4x) can fall inside one trial, between a baseline and a confirm
  that both saw the slow phase, and an A-B-A alone cannot tell that from a gain. The check is
  the incumbent measured at once, in the trial's context: it costs what the search's confirm
  would (the check stands in for it when the trial stays the winner).
"""

from __future__ import annotations

import logging

from autobyte.types import StepMetrics

from autobyted.tuner.actions import STAY, Accept, Action, Check
from autobyted.tuner.drift import Alarm, fastest_in_context, favourable_move
from autobyted.tuner.job import Search, TunerJob
from autobyted.tuner.measured import MeasuredWindow
from autobyted.tuner.phases import Phase
from autobyted.tuner.verdict import clearly_worse, unexplained_jump

log = logging.getLogger(__name__)


class Exploring(Phase):
    """One trial's window: cut early when clearly worse, then checked, accepted or both."""

    def __init__(self, job: TunerJob, search: Search, trial: MeasuredWindow) -> None:
        super().__init__(job)
        self.search, self.trial = search, trial

    def on_sample(self, m: StepMetrics) -> Action:
        job, search, trial, params = self.job, self.search, self.trial, self.job.params
        trial.samples.append(m)
        n = len(trial.samples)
        length = job.window(params.trial_steps, params.trial_window_s)
        if n >= params.min_trial_steps and n < length and self._clearly_worse():
            trial.cut = True
        if not trial.cut and n < length:
            return STAY
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
        if jump is None and not trial.cut and trial.median_s * (1 + params.min_gain) >= fastest:
            jump = self._favourable_move_behind_a_lead()
        if jump is not None and (jump.signal, jump.direction) not in search.cleared:
            # A jump no configuration explains: did the context move while the trial ran? Measure
            # the incumbent again before trusting the comparison.
            return Check(search, trial, jump, fastest)
        return Accept(search, trial)

    def _favourable_move_behind_a_lead(self) -> Alarm | None:
        """A move of the context in the trial's favour that could explain why the trial leads the
        search (module docstring); None for a trial that does not lead it."""
        job, trial = self.job, self.trial
        assert job.incumbent is not None
        best = min([job.incumbent.median_s] + [t.median_s for t in self.search.trials if not t.cut])
        if trial.median_s * (1 + job.params.min_gain) >= best:
            return None
        return favourable_move(job.incumbent.samples, trial.samples)

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
