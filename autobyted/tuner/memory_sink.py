"""The tuner's in-memory sink: what a `JobTuner` would write to the daemon's storage, kept in lists
(for the simulator's `autobyte` policy and for tests that drive a tuner without a database)."""

from __future__ import annotations

import dataclasses

from autobyte.types import Config

from autobyted.storage.records import TunerStatusRecord
from autobyted.tuner.predictor import Window
from autobyted.tuner.sink import TunerSink


@dataclasses.dataclass
class MemoryDecision:
    decision_id: int
    config: Config
    apply_at_step: int
    reason: str
    kind: str
    predicted_step_time_s: float | None
    measured_step_time_s: float | None = None
    state: str = "pending"
    applied_at_step: int | None = None


class MemorySink(TunerSink):
    """Collects what the tuner would write to the daemon's storage."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.decisions: list[MemoryDecision] = []
        self.windows: list[Window] = []
        self.statuses: list[TunerStatusRecord] = []

    def decide(self, config, apply_at_step, reason, predicted_step_time_s, kind):
        decision = MemoryDecision(
            len(self.decisions) + 1,
            config,
            apply_at_step,
            reason,
            kind,
            predicted_step_time_s,
            state="recommended" if kind == "recommend" else "pending",
        )
        self.decisions.append(decision)
        return decision.decision_id

    def close_decision(self, decision_id, measured_step_time_s, state):
        decision = self.decisions[decision_id - 1]
        if measured_step_time_s is not None:
            decision.measured_step_time_s = measured_step_time_s
        if state is not None:
            decision.state = state

    def record_window(self, window):
        self.windows.append(window)

    def publish(self, status):
        self.statuses.append(status)
