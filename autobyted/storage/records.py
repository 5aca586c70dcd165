"""Frozen values the storage returns; ORM rows never leave the storage package."""

from __future__ import annotations

import dataclasses

from autobyte.records import (
    BestRecord,
    CandidateRecord,
    DecisionRecord,
    Fingerprint,
    HistoryStep,
    JobRecord,
    MemoryLimits,
    Registration,
    ShardLayout,
    TunerStatusRecord,
)
from autobyte.types import Config, StepMetrics

# The values that cross the wire live with the protocol (autobyte.records); storage returns them too.
__all__ = [
    "BestRecord",
    "CandidateRecord",
    "DecisionRecord",
    "Fingerprint",
    "HistoryStep",
    "JobInfo",
    "JobRecord",
    "LeaseRecord",
    "MemoryLimits",
    "ModelRecord",
    "RegisterResult",
    "Registration",
    "SampleBatch",
    "SampleRow",
    "ShardLayout",
    "TunerStatusRecord",
    "WindowRecord",
    "tuner_lease",
]


@dataclasses.dataclass(frozen=True)
class RegisterResult:
    session_id: str
    last_acked_seq: int


@dataclasses.dataclass(frozen=True)
class SampleBatch:
    """Validated samples of one (job, rank, session) in seq order."""

    job: str
    rank: int
    session_id: str
    samples: tuple[tuple[int, StepMetrics], ...]
    dropped_total: int = 0
    final: bool = False  # the rank's last batch: its process is shutting down


@dataclasses.dataclass(frozen=True)
class JobInfo:
    """What a job's registration told the daemon: the tuner's "registration info"."""

    job: str
    world_size: int
    backend: str
    fingerprint: Fingerprint
    tuning_disabled: bool
    created_at_s: float
    last_seen_s: float
    finished_at_s: float | None = None  # every rank said goodbye (their last, at this time)
    engine: str = "scheduler"  # autobyte.types.ENGINES
    memory: MemoryLimits | None = None  # an FSDP2 job's budget (rank 0's registration)
    collective_latency_s: float = 0.0  # rank 0's measured small all-reduce (0.0: unknown)
    shard_layout: ShardLayout | None = None  # an FSDP2 job's groups (rank 0's registration)


@dataclasses.dataclass(frozen=True)
class SampleRow:
    """One stored sample with its row id (the tuner reads a job's samples incrementally by id)."""

    row_id: int
    rank: int
    metrics: StepMetrics


@dataclasses.dataclass(frozen=True)
class WindowRecord:
    """A measured window of one configuration in one context segment of a job (training data)."""

    job: str
    segment: int
    config: Config
    step_time_s: float
    samples: int
    context: str  # JSON of autobyted.tuner.features.Context
    created_at_s: float = 0.0
    window_id: int = 0


@dataclasses.dataclass(frozen=True)
class ModelRecord:
    model_id: int
    kind: str
    examples: int
    model: bytes
    note: str
    created_at_s: float


@dataclasses.dataclass(frozen=True)
class LeaseRecord:
    """Who holds a lease (storage.base.BaseStorage.acquire_lease) and for how much longer."""

    name: str
    holder: str
    acquired_at_s: float
    expires_in_s: float  # negative: expired, free for any daemon to take


def tuner_lease(job: str) -> str:
    """The name of the lease a daemon holds while it tunes `job`."""
    return f"tuner:{job}"
