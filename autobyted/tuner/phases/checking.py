"""Checking and confirming: the incumbent measured again.

- checking: after a trial whose context jumped more than any configuration explains
  (tuner.phases.exploring): if the incumbent moved too, the search restarts in the new context
  (actions.Abort); else the trial counts.
- confirming: before switching to a search's winner that no check followed (an A-B-A design): if
  the incumbent moved, the context drifted while the trials ran (a ramp, a neighbour), and the
  search is repeated in the context as it is now.

Both are a sequential test with two looks: after `min_trial_steps` steps it ends as soon as the
trial beats both measurements of the incumbent (verdict.trial_beats_both: then no move of the
context explains the gain away), else at its full window. A check after the search's winner was
measured that found the incumbent where it was is that winner's A-B-A, and no separate confirm
follows.
"""

from __future__ import annotations

from autobyte.types import StepMetrics

from autobyted.tuner.actions import STAY, Abort, Accept, Action, Finish
from autobyted.tuner.drift import Alarm
from autobyted.tuner.job import Search, TunerJob
from autobyted.tuner.measured import MeasuredWindow
from autobyted.tuner.phases import Phase
from autobyted.tuner.verdict import moved, trial_beats_both


class _Remeasure(Phase):
    """The incumbent's window again, against `trial` (the suspect trial, or the winner)."""

    def __init__(
        self, job: TunerJob, search: Search, trial: MeasuredWindow, decision_id: int
    ) -> None:
        super().__init__(job)
        self.search, self.trial, self.decision_id = search, trial, decision_id
        self.window: list[StepMetrics] = []

    def _measure(self, m: StepMetrics) -> tuple[MeasuredWindow, bool] | None:
        """The incumbent measured again, and whether it ended at the early look; None until
        then."""
        self.window.append(m)
        incumbent = self.job.incumbent
        assert incumbent is not None
        early = self._early_window(incumbent)
        if early is None and len(self.window) < self.search.window_steps:
            return None
        again = early or MeasuredWindow(incumbent.config, list(self.window))
        self.job.sink.close_decision(self.decision_id, again.median_s, None)
        return again, early is not None

    def _early_window(self, before: MeasuredWindow) -> MeasuredWindow | None:
        """The window so far, at the sequential look after `min_trial_steps` steps, when the
        trial already beats both measurements of the incumbent (the answer of the full window
        cannot change then); else None (measure on)."""
        if (
            len(self.window) != self.job.params.min_trial_steps
            or len(self.window) >= self.search.window_steps
        ):
            return None
        again = MeasuredWindow(before.config, list(self.window))
        beats = trial_beats_both(self.trial, before, again, self.job.sigma, self.job.params)
        return again if beats else None


class Checking(_Remeasure):
    """After a suspicious trial: same context -> the trial counts; moved -> re-tune in the new
    context."""

    def __init__(
        self,
        job: TunerJob,
        search: Search,
        trial: MeasuredWindow,
        jump: Alarm,
        decision_id: int,
    ) -> None:
        super().__init__(job, search, trial, decision_id)
        self.jump = jump

    def on_sample(self, m: StepMetrics) -> Action:
        measured = self._measure(m)
        if measured is None:
            return STAY
        again, early = measured
        job, search, trial, jump = self.job, self.search, self.trial, self.jump
        incumbent = job.incumbent
        assert incumbent is not None
        shift = moved(incumbent, again, job.sigma, job.params)
        credit_against_the_faster(trial, incumbent, again, shift)
        if early:
            # The trial beats the incumbent before and after it by the switch margin: the
            # comparison holds whatever the context did (not measured long enough to clear the
            # jump itself).
            return Accept(search, trial, checked=(trial,))
        if shift is None or trial_beats_both(trial, incumbent, again, job.sigma, job.params):
            # Same context, or a move smaller than the trial's gain: the comparison holds either
            # way. Same context: every trial so far was measured between two equal measurements of
            # the incumbent (their A-B-A); a move: the suspect trial alone beat both.
            return Accept(
                search,
                trial,
                checked=(*search.trials, trial) if shift is None else (trial,),
                cleared=(jump.signal, jump.direction),
            )
        return Abort(search, shift, again)


class Confirming(_Remeasure):
    """Before switching to the search's winner (`trial` here): the incumbent where it was ->
    switch (actions.Finish, confirmed); moved -> re-tune, unless the winner beats both."""

    def on_sample(self, m: StepMetrics) -> Action:
        measured = self._measure(m)
        if measured is None:
            return STAY
        again, early = measured
        job, search, winner = self.job, self.search, self.trial
        incumbent = job.incumbent
        assert incumbent is not None
        shift = moved(incumbent, again, job.sigma, job.params)
        if (
            not early
            and shift is not None
            and not trial_beats_both(winner, incumbent, again, job.sigma, job.params)
        ):
            return Abort(search, shift, again)
        credit_against_the_faster(winner, incumbent, again, shift)
        return Finish(search, confirmed=True)


def credit_against_the_faster(
    trial: MeasuredWindow, incumbent: MeasuredWindow, again: MeasuredWindow, shift: Alarm | None
) -> None:
    """A trial that beat the incumbent measured before and after it, where the incumbent moved
    between the two: its gain is what it beat the faster of them by (its figure in the switch's
    reason and status, and what the predictor learns from it: MeasuredWindow.incumbent_s), not
    what it beat the incumbent by in another context."""
    if shift is not None:
        trial.incumbent_s = min(trial.against(incumbent), again.median_s)
