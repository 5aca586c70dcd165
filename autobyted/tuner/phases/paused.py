"""Paused: an operator decided (`autobyte propose`) or paused the tuner; JobTuner skips the job's
samples until `resume` opens a new baseline."""

from __future__ import annotations

from autobyte.types import StepMetrics

from autobyted.tuner.job import TunerJob
from autobyted.tuner.phases import Phase


class Paused(Phase):
    def on_sample(self, m: StepMetrics) -> Phase:
        return self  # JobTuner does not dispatch while paused


def enter(job: TunerJob, why: str = "an operator decided") -> Paused:
    """Pause: forget the decision in flight and say how to hand the job back."""
    job.paused = True
    job.pending = None
    job.set("paused", f"paused: {why}; `autobyte tune {job.job} --resume` hands it back")
    return Paused(job)
