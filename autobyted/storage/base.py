"""The storage contract every backend implements (and tests/test_storage_contract.py checks)."""

from __future__ import annotations

import abc
from typing import Sequence

from autobyte.types import Config
from autobyted.storage.records import (BestRecord, DecisionRecord, JobRecord, RegisterResult,
                                       Registration, SampleBatch, StepRecord)


class BaseStorage(abc.ABC):
    @abc.abstractmethod
    def register(self, registration: Registration, liveness_s: float) -> RegisterResult:
        """Record a rank. The same instance may re-register; another live instance of the same
        (job, rank) raises AlreadyExists; a different world size for a known job raises
        FailedPrecondition."""

    @abc.abstractmethod
    def append_samples(self, batches: Sequence[SampleBatch]) -> list[int]:
        """Store the batches atomically; return per batch the highest seq now stored for its rank.
        Samples with a seq already stored are ignored (a resend after a lost ack)."""

    @abc.abstractmethod
    def record_applied_config(self, job: str, rank: int, decision_id: int, config: Config,
                              applied_at_step: int) -> None: ...

    @abc.abstractmethod
    def add_decision(self, job: str, config: Config, apply_at_step: int, reason: str,
                     predicted_step_time_s: float | None = None) -> DecisionRecord: ...

    @abc.abstractmethod
    def decisions(self, job: str, after_decision_id: int = 0) -> list[DecisionRecord]: ...

    @abc.abstractmethod
    def jobs(self, running_within_s: float) -> list[JobRecord]: ...

    @abc.abstractmethod
    def history(self, job: str, since_s: float = 0.0, rank: int | None = None,
                limit: int = 1000) -> list[StepRecord]:
        """The latest `limit` step records (ascending by step) of a job; NotFound if unknown."""

    @abc.abstractmethod
    def best(self, job: str, min_samples: int = 5) -> BestRecord: ...

    @abc.abstractmethod
    def enforce_retention(self, max_raw_samples: int, keep_every: int) -> int:
        """Downsample old raw samples beyond max_raw_samples per job; return rows removed."""

    @abc.abstractmethod
    def sample_count(self, job: str | None = None) -> int: ...
