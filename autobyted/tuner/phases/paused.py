"""Paused: an operator decided (`autobyte propose`) or paused the tuner, or a decision was refused;
JobTuner skips the job's samples until `resume` opens a new baseline."""

from __future__ import annotations

from autobyte.types import StepMetrics

from autobyted.tuner.actions import STAY, Action
from autobyted.tuner.phases import Phase


class Paused(Phase):
    def on_sample(self, m: StepMetrics) -> Action:
        return STAY  # JobTuner does not dispatch while paused
