"""Verifying: after switching to the search's winner (tuner.transitions' `finish`), one window
checks it: if a context signal moved since the winner's trial (drift.window_shift), re-tune
(actions.Abort); if it is slower than the incumbent beyond the noise, roll back (actions.RollBack);
if it is not, but its own step time moved since its trial (verdict.moved), re-tune too. The last
catches a move no signal shows that came and went while the trials ran (a link's rate swinging
back before the confirm, its bandwidth estimate held at the compute's pace while partitions wait
for gradients): the incumbent measured before and after the trials agree, and only the winner's
own window shows that its gain was the context's. A warm start's switch is kept when its window
measures at least `min_gain` over the incumbent (actions.Verified), else it counts as a lost
trial (actions.WarmStartLost).
"""

from __future__ import annotations

import math

from autobyte.types import StepMetrics

from autobyted.tuner.actions import (
    STAY,
    Abort,
    Action,
    RollBack,
    Verified,
    WarmStartLost,
)
from autobyted.tuner.drift import window_shift
from autobyted.tuner.job import Search, TunerJob
from autobyted.tuner.measured import MeasuredWindow
from autobyted.tuner.phases import Phase
from autobyted.tuner.verdict import moved, rolls_back


class Verifying(Phase):
    """The winner's window after the switch: kept, rolled back, or the search re-opened."""

    def __init__(
        self, job: TunerJob, search: Search, winner: MeasuredWindow, decision_id: int
    ) -> None:
        super().__init__(job)
        self.search, self.winner, self.decision_id = search, winner, decision_id
        self.window: list[StepMetrics] = []

    def on_sample(self, m: StepMetrics) -> Action:
        job, search, params = self.job, self.search, self.job.params
        self.window.append(m)
        if len(self.window) < search.window_steps:
            return STAY
        winner, incumbent = self.winner, job.incumbent
        assert incumbent is not None
        measured = MeasuredWindow(winner.config, list(self.window), self.decision_id)
        job.learn_noise(measured.samples)
        job.sink.close_decision(self.decision_id, measured.median_s, None)
        if not winner.samples and winner is not incumbent:  # a warm start's switch
            if incumbent.log_median - measured.log_median >= math.log1p(params.min_gain):
                return Verified(search, winner, measured)
            measured.predicted_log = winner.predicted_log
            return WarmStartLost(search, measured)
        shift = window_shift(winner.samples, measured.samples)
        if shift is not None:
            return Abort(search, shift, measured)
        if winner is not incumbent and rolls_back(
            measured.log_median,
            len(measured.samples),
            incumbent.log_median,
            len(incumbent.samples),
            job.sigma,
            params,
        ):
            return RollBack(search, winner, measured)
        # Not slower than the incumbent, but not what its trial measured either: the comparison
        # the switch was made on does not hold here; search again in the context as it is now.
        shift = moved(winner, measured, job.sigma, params)
        if shift is not None:
            return Abort(search, shift, measured)
        return Verified(search, winner, measured)
