"""SQLAlchemy 2.x models. Every change here ships an Alembic revision in migrations/versions."""

from __future__ import annotations

import dataclasses

from autobyte.sample_schema import SAMPLE_COLUMNS
from autobyte.types import Config
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


_COLUMN_KINDS = {"int64": BigInteger, "int32": Integer, "float": Float, "bool": Boolean}


class ConfigColumns:
    """A configuration's columns, one per Config field (autobyte/types.py), NULL where the field is
    None, in every table that holds one (a job's configuration in effect, a decision's, an applied
    one, the tuner's, a measured window's). Migrations: 0005 added tail_bytes, 0006 FSDP2's knobs."""


for _field in dataclasses.fields(Config):
    setattr(
        ConfigColumns,
        _field.name,
        mapped_column(_COLUMN_KINDS[_field.metadata["column"]](), nullable=True),
    )


# Row ids of the tables that grow with every step or decision: 64-bit on every database. SQLite
# keeps INTEGER (its rowid is 64-bit already, and only INTEGER PRIMARY KEY aliases it).
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Job(ConfigColumns, Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    world_size: Mapped[int] = mapped_column(Integer)
    backend: Mapped[str] = mapped_column(String(32))
    model_digest: Mapped[str] = mapped_column(String(64))
    parameter_count: Mapped[int] = mapped_column(BigInteger)
    parameter_bytes: Mapped[int] = mapped_column(BigInteger)
    tensor_count: Mapped[int] = mapped_column(Integer)
    largest_tensor_bytes: Mapped[int] = mapped_column(BigInteger)
    median_tensor_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[float] = mapped_column(Float)
    last_seen_at: Mapped[float] = mapped_column(Float)
    max_step: Mapped[int] = mapped_column(BigInteger, default=-1)
    # The configuration in effect (ConfigColumns), as last reported by rank 0. Its one source
    # is what rank 0's steps ran with: every sample carries it, and the ReportConfig a rank sends when
    # a decision took effect is built from that step's sample (autobyte/transport/control.py). Both
    # arrive here through one writer (storage/sql.py, _set_config): samples as they are stored, the
    # report at once (it also marks the decision applied).
    dropped_total: Mapped[int] = mapped_column(BigInteger, default=0)
    # Rank 0 registered with autobyte.init(tune=False): the tuner leaves this job alone.
    tuning_disabled: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # 0006: the engine the job runs (autobyte.types.ENGINES), from its registration.
    engine: Mapped[str] = mapped_column(String(16), default="scheduler", server_default="scheduler")
    # 0007: an FSDP2 job's memory budget and the configurations over it (autobyte.records
    # MemoryLimits, from rank 0's registration; NULL: no budget).
    memory_budget_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    over_budget: Mapped[str | None] = mapped_column(Text, nullable=True)
    # 0008: one small all-reduce (4 KB of fp32) on the job's group as rank 0 measured it when its
    # scheduler was built (seconds; NULL: not measured): the predictor's per-collective cost.
    collective_latency_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    # 0010: an FSDP2 job's groups (autobyte.records.ShardLayout as JSON, from rank 0's
    # registration; NULL: a scheduler job or an old client): the daemon's model of its schedule.
    shard_layout: Mapped[str | None] = mapped_column(Text, nullable=True)


class Rank(Base):
    __tablename__ = "ranks"
    __table_args__ = (UniqueConstraint("job_id", "rank"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    instance_id: Mapped[str] = mapped_column(String(128))
    session_id: Mapped[str] = mapped_column(String(64))
    hostname: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    registered_at: Mapped[float] = mapped_column(Float)
    last_seen_at: Mapped[float] = mapped_column(Float)
    # Highest sample seq of this instance that is stored: the ack the client may rely on.
    last_acked_seq: Mapped[int] = mapped_column(BigInteger, default=0)
    dropped_total: Mapped[int] = mapped_column(BigInteger, default=0)
    # When this rank's process said it was shutting down (its last batch); NULL while it runs.
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class StepSample(Base):
    """One rank's step: its columns are StepMetrics' fields (autobyte/sample_schema.py)."""

    __table__ = Table(
        "step_metrics",
        Base.metadata,
        Column("id", BigId, primary_key=True),
        Column("job_id", Integer, ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        Column("rank", Integer, nullable=False),
        *(
            Column(
                column.name,
                _COLUMN_KINDS[column.kind](),
                nullable=column.nullable,
                server_default=column.server_default,
            )
            for column in SAMPLE_COLUMNS
        ),
        Index("ix_step_metrics_job_step", "job_id", "step"),
        Index("ix_step_metrics_job_wall", "job_id", "wall_time_s"),
    )


class Decision(ConfigColumns, Base):
    __tablename__ = "decisions"
    # (job, id): a job's newest decision is one index probe (every daemon polls it, decisions.py).
    __table_args__ = (Index("ix_decisions_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    apply_at_step: Mapped[int] = mapped_column(BigInteger)
    reason: Mapped[str] = mapped_column(Text)
    predicted_step_time_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    measured_step_time_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    # pending | applied | superseded (by a newer decision) | expired (its run ended first) | rolled_back
    state: Mapped[str] = mapped_column(String(16))
    applied_at_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    source: Mapped[str] = mapped_column(String(16), default="operator", server_default="operator")


class AppliedConfig(ConfigColumns, Base):
    """What a rank reported as actually in effect, and from which step."""

    __tablename__ = "configurations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    decision_id: Mapped[int] = mapped_column(BigInteger)
    applied_at_step: Mapped[int] = mapped_column(BigInteger)
    reported_at: Mapped[float] = mapped_column(Float)


class TunerState(ConfigColumns, Base):
    """What the tuner is doing for a job (one row per job it has looked at), shown by `status`.
    `paused` is the operator's: set by a proposal or `autobyte tune --pause`, cleared by --resume."""

    __tablename__ = "tuner_states"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    mode: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(32))
    detail: Mapped[str] = mapped_column(Text)
    baseline_step_time_s: Mapped[float] = mapped_column(Float)
    measured_step_time_s: Mapped[float] = mapped_column(Float)
    predicted_step_time_s: Mapped[float] = mapped_column(Float)
    trials_done: Mapped[int] = mapped_column(Integer)
    trials_planned: Mapped[int] = mapped_column(Integer)
    paused: Mapped[bool] = mapped_column(Boolean, default=False)
    updated_at: Mapped[float] = mapped_column(Float)


class TunerWindow(ConfigColumns, Base):
    """One measured window of one configuration in one context of a job: the predictor's training
    data (pairs of windows of the same job and context segment). `context` is JSON (features.py)."""

    __tablename__ = "tuner_windows"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    segment: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    step_time_s: Mapped[float] = mapped_column(Float)
    samples: Mapped[int] = mapped_column(Integer)
    context: Mapped[str] = mapped_column(Text)


class PredictorModel(Base):
    """A trained predictor (serialised ensemble), newest last; a restarted daemon loads the newest."""

    __tablename__ = "predictor_models"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(16))
    examples: Mapped[int] = mapped_column(Integer)
    model: Mapped[bytes] = mapped_column(LargeBinary)
    note: Mapped[str] = mapped_column(Text)


class Lease(Base):
    """Work that one daemon at a time does for every daemon sharing the database (e.g. tuning one
    job: name "tuner:<job>"). The holder renews it before `expires_at`; once that passes, any daemon
    may take it over. Times are the database's own clock (storage/sql.py), not a daemon host's."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(300), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))
    acquired_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)
