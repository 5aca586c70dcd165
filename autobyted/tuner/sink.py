"""Where a JobTuner's effects go: the daemon's storage and control path (tuner.manager), or memory
(tuner.memory_sink, for the simulator and tests)."""

from __future__ import annotations

import abc

from autobyte.types import Config

from autobyted.storage.records import TunerStatusRecord
from autobyted.tuner.predictor import Window


class TunerSink(abc.ABC):
    """Where a JobTuner's effects go (storage + control path in the daemon; memory in benchmarks)."""

    @abc.abstractmethod
    def decide(
        self,
        config: Config,
        apply_at_step: int,
        reason: str,
        predicted_step_time_s: float | None,
        kind: str,
    ) -> int | None:
        """Issue a decision (kind: trial, switch, return, rollback) or only record one (kind
        "recommend", observe mode); its id, or None if refused because an operator has paused the
        tuner for the job."""

    @abc.abstractmethod
    def close_decision(
        self, decision_id: int, measured_step_time_s: float | None, state: str | None
    ) -> None: ...

    @abc.abstractmethod
    def record_window(self, window: Window) -> None: ...

    @abc.abstractmethod
    def publish(self, status: TunerStatusRecord) -> None: ...
