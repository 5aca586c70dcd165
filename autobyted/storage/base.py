"""The storage contract every backend implements (and tests/test_storage_contract.py checks)."""

from __future__ import annotations

import abc
from collections.abc import Sequence

from autobyte.types import Config

from autobyted.contexts import StepPoint
from autobyted.storage.records import (
    DecisionRecord,
    HistoryStep,
    JobInfo,
    JobRecord,
    LeaseRecord,
    ModelRecord,
    RegisterResult,
    Registration,
    SampleBatch,
    SampleRow,
    TunerStatusRecord,
    WindowRecord,
)


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
    def record_applied_config(
        self, job: str, rank: int, decision_id: int, config: Config, applied_at_step: int
    ) -> None: ...

    @abc.abstractmethod
    def add_decision(
        self,
        job: str,
        config: Config,
        apply_at_step: int,
        reason: str,
        predicted_step_time_s: float | None = None,
        source: str = "operator",
        state: str = "pending",
        lease_holder: str | None = None,
    ) -> DecisionRecord:
        """Store a decision. A pending one supersedes the job's pending ones. An operator's decision
        pauses the job's tuner (in the same transaction); a tuner's decision for a paused job raises
        FailedPrecondition (so an operator's word is never overwritten by a tuner that had not
        noticed it yet). With lease_holder, FailedPrecondition too unless that holder holds the
        job's tuner lease (records.tuner_lease) now: a daemon that lost it decides nothing."""

    @abc.abstractmethod
    def close_decision(
        self, decision_id: int, measured_step_time_s: float | None, state: str | None = None
    ) -> None:
        """Record a decision's measured effect (and a new state, e.g. rolled_back)."""

    @abc.abstractmethod
    def decisions(self, job: str, after_decision_id: int = 0) -> list[DecisionRecord]: ...

    @abc.abstractmethod
    def newest_decision_ids(self, jobs: Sequence[str]) -> dict[str, int]:
        """The newest decision id of each known job among `jobs` (0: none yet); every daemon polls it
        to wake its control streams for decisions another daemon stored."""

    @abc.abstractmethod
    def jobs(self, running_within_s: float) -> list[JobRecord]: ...

    @abc.abstractmethod
    def history(
        self, job: str, since_s: float = 0.0, rank: int | None = None, limit: int = 1000
    ) -> list[HistoryStep]:
        """The latest `limit` step records (ascending by step) of a job; NotFound if unknown."""

    @abc.abstractmethod
    def rank0_points(self, job: str) -> list[StepPoint]:
        """Rank 0's steps of a job in time order, as `autobyted.best` and `autobyted.contexts`
        read them; NotFound if unknown."""

    @abc.abstractmethod
    def enforce_retention(self, max_raw_samples: int, keep_every: int) -> int:
        """Downsample old raw samples beyond max_raw_samples per job; return rows removed."""

    @abc.abstractmethod
    def sample_count(self, job: str | None = None) -> int: ...

    # ------------------------------------------------------------------ the tuner's
    @abc.abstractmethod
    def job_info(self, job: str) -> JobInfo:
        """Registration info of a job; NotFound if unknown."""

    @abc.abstractmethod
    def active_jobs(self, seen_within_s: float) -> list[str]:
        """Names of jobs heard from within the last seen_within_s seconds."""

    @abc.abstractmethod
    def samples_after(
        self, job: str, after_row_id: int, rank: int | None = 0, limit: int = 10_000
    ) -> list[SampleRow]:
        """A job's samples with a row id above after_row_id, ascending, at most `limit`
        (rank None: every rank). NotFound if the job is unknown."""

    @abc.abstractmethod
    def last_sample_row(self, job: str, rank: int | None = 0) -> int:
        """The highest row id of a job's samples (0 when none); NotFound if the job is unknown."""

    @abc.abstractmethod
    def tuner_status(self, job: str) -> TunerStatusRecord | None: ...

    @abc.abstractmethod
    def save_tuner_status(self, job: str, status: TunerStatusRecord) -> None:
        """Store what the tuner does for a job; the operator's `paused` flag is kept as stored."""

    @abc.abstractmethod
    def set_tuning_paused(self, job: str, paused: bool) -> TunerStatusRecord:
        """The operator pauses or resumes the tuner for a job."""

    @abc.abstractmethod
    def add_window(self, window: WindowRecord) -> int: ...

    @abc.abstractmethod
    def windows(
        self, after_window_id: int = 0, limit: int = 100_000, newest: bool = False
    ) -> list[WindowRecord]:
        """Measured windows of every job, ascending by id: the first `limit` after after_window_id,
        or (newest=True) the last `limit`."""

    @abc.abstractmethod
    def next_window_segment(self, job: str) -> int:
        """One past the highest context segment of the job's stored windows (0 when it has none):
        where a new tuner of the job starts numbering, so that two runs of one job name never share
        a segment."""

    @abc.abstractmethod
    def save_model(
        self, kind: str, model: bytes, examples: int, note: str = "", keep: int = 3
    ) -> int:
        """Store a trained predictor; only the newest `keep` are kept."""

    @abc.abstractmethod
    def latest_model(self) -> ModelRecord | None: ...

    # ------------------------------------------------------------------ daemons sharing the database
    @abc.abstractmethod
    def acquire_lease(self, name: str, holder: str, duration_s: float) -> bool:
        """Take the lease `name` for `duration_s` seconds, or renew it when `holder` holds it; True
        when `holder` holds it now. A lease whose holder let it expire (died, stalled) is taken over.
        The database's clock decides expiry, so daemons on hosts with skewed clocks agree."""

    @abc.abstractmethod
    def release_lease(self, name: str, holder: str) -> None:
        """Give the lease up at once (a daemon that stops), if `holder` holds it."""

    @abc.abstractmethod
    def lease(self, name: str) -> LeaseRecord | None: ...
