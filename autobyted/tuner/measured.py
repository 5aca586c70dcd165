"""The records a job's search keeps: a measured window of one configuration, and a decision the
tuner waits for the job to apply."""

from __future__ import annotations

import dataclasses
import math
import statistics

from autobyte.types import Config, StepMetrics


@dataclasses.dataclass
class MeasuredWindow:
    """Steps of one configuration, measured in one phase of a search (a baseline, a trial, a check,
    a verification)."""

    config: Config
    samples: list[StepMetrics]
    decision_id: int = 0
    predicted_log: float = 0.0  # predicted log ratio to the search's incumbent
    cut: bool = False  # ended early by the sequential test
    # The model's predicted log ratio to the reference it was scored from, before this search's
    # gain calibration, and that reference's log median then (verdict.gain_calibration's evidence).
    model_log: float | None = None
    reference_log: float = 0.0
    # The incumbent's median step time to compare this window with, where the incumbent was
    # measured again after it and had moved, but this window still beat both measurements
    # (tuner.phases.checking): the faster of the two, the gain that holds in either context. None:
    # the search's incumbent's own.
    incumbent_s: float | None = None

    def against(self, incumbent: MeasuredWindow) -> float:
        """The incumbent's median step time this window is compared with (`incumbent_s`)."""
        return incumbent.median_s if self.incumbent_s is None else self.incumbent_s

    @property
    def log_median(self) -> float:
        return statistics.median(math.log(s.step_time_s) for s in self.samples)

    @property
    def median_s(self) -> float:
        return statistics.median(s.step_time_s for s in self.samples)


@dataclasses.dataclass
class PendingDecision:
    """A decision issued to the job and not yet seen in effect in its samples."""

    decision_id: int
    config: Config
    apply_at_step: int
    issued_wall_s: (
        float  # the newest sample's wall time when the decision was made (the job's clock)
    )
