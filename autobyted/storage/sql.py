"""SQLAlchemy implementation of the storage contract (SQLite by default, any SQLAlchemy URL)."""

from __future__ import annotations

import dataclasses
import statistics
import time
import uuid
from collections.abc import Callable, Sequence

import sqlalchemy as sa
from autobyte.records import history_step
from autobyte.sample_schema import SAMPLE_COLUMN_NAMES, sample_from_row, sample_row
from autobyte.types import Config
from sqlalchemy.engine import Engine

from autobyted.contexts import StepPoint
from autobyted.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from autobyted.storage import models as m
from autobyted.storage.base import BaseStorage
from autobyted.storage.db import SessionScope
from autobyted.storage.records import (
    DecisionRecord,
    Fingerprint,
    HistoryStep,
    JobInfo,
    JobRecord,
    LeaseRecord,
    MemoryLimits,
    ModelRecord,
    RegisterResult,
    Registration,
    SampleBatch,
    SampleRow,
    ShardLayout,
    TunerStatusRecord,
    WindowRecord,
    tuner_lease,
)

RETENTION_CHUNK_ROWS = 20_000


_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(Config))


def _config(row) -> Config:
    """The configuration a row holds in its columns named as Config's fields."""
    return Config(*(getattr(row, name) for name in _CONFIG_FIELDS))


def _memory_columns(memory: MemoryLimits | None) -> dict:
    """The job's memory columns for a registration's limits (both NULL without a budget)."""
    if memory is None:
        return {"memory_budget_bytes": None, "over_budget": None}
    return {"memory_budget_bytes": memory.budget_bytes, "over_budget": memory.over_budget_json()}


def _layout_column(layout: ShardLayout | None) -> str | None:
    """The job's shard_layout column (NULL without a layout)."""
    return None if layout is None else layout.to_json()


def _config_columns(config: Config) -> dict[str, int | None]:
    """A configuration as the values of the columns named as Config's fields (every table that holds one)."""
    return dataclasses.asdict(config)


def _set_config(row, config: Config) -> None:
    """Write a configuration into a row's columns named as Config's fields."""
    for name, value in _config_columns(config).items():
        setattr(row, name, value)


def _decision(row: m.Decision, job: str) -> DecisionRecord:
    return DecisionRecord(
        decision_id=row.id,
        job=job,
        config=_config(row),
        apply_at_step=row.apply_at_step,
        reason=row.reason,
        created_at_s=row.created_at,
        state=row.state,
        predicted_step_time_s=row.predicted_step_time_s,
        measured_step_time_s=row.measured_step_time_s,
        applied_at_step=row.applied_at_step,
        source=row.source,
    )


def _tuner_status(row: m.TunerState) -> TunerStatusRecord:
    return TunerStatusRecord(
        mode=row.mode,
        state=row.state,
        detail=row.detail,
        config=_config(row),
        baseline_step_time_s=row.baseline_step_time_s,
        measured_step_time_s=row.measured_step_time_s,
        predicted_step_time_s=row.predicted_step_time_s,
        trials_done=row.trials_done,
        trials_planned=row.trials_planned,
        paused=row.paused,
        updated_at_s=row.updated_at,
    )


# The columns of a stored sample, in the order append_samples builds its rows: the job and rank,
# then StepMetrics' own (autobyte/sample_schema.py).
SAMPLE_COLUMNS = ("job_id", "rank", *SAMPLE_COLUMN_NAMES)
_METRIC_COLUMNS = tuple(m.StepSample.__table__.c[name] for name in SAMPLE_COLUMN_NAMES)


def _insert_samples(connection: sa.Connection, rows: list[tuple]) -> None:
    """Insert sample rows in the connection's transaction, by the fastest path of its driver: COPY
    on PostgreSQL (psycopg), one executemany of a plain INSERT elsewhere. Building SQLAlchemy
    parameters per row costs more than the database's own work (tens of µs a sample)."""
    columns = ", ".join(SAMPLE_COLUMNS)
    dialect = connection.dialect
    if dialect.name == "postgresql" and dialect.driver == "psycopg":
        with (
            connection.connection.dbapi_connection.cursor() as cursor,
            cursor.copy(f"COPY {m.StepSample.__table__.name} ({columns}) FROM STDIN") as copy,
        ):
            for row in rows:
                copy.write_row(row)
        return
    marker = "?" if dialect.paramstyle == "qmark" else "%s"
    connection.exec_driver_sql(
        f"INSERT INTO {m.StepSample.__table__.name} ({columns}) VALUES "
        f"({', '.join([marker] * len(SAMPLE_COLUMNS))})",
        rows,
    )


class SqlStorage(BaseStorage):
    def __init__(self, engine: Engine, lease_clock: Callable[[], float] | None = None) -> None:
        """lease_clock: seconds since the epoch for lease expiry instead of the database's clock
        (tests drive it; daemons leave it None so that they agree whatever their hosts' clocks)."""
        self._engine = engine
        self._scope = SessionScope(engine)
        self._lease_clock = lease_clock

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _job(session, name: str, lock: bool = False) -> m.Job:
        """The job's row; lock=True holds it (FOR UPDATE on PostgreSQL; SQLite has one writer at a
        time anyway) until the transaction ends, so that writers of one job take turns."""
        query = sa.select(m.Job).where(m.Job.name == name)
        job = session.scalars(query.with_for_update() if lock else query).one_or_none()
        if job is None:
            raise NotFound(
                f"unknown job {name!r}; `autobyte status` lists the jobs the daemon knows"
            )
        return job

    # ------------------------------------------------------------------ telemetry
    def register(self, registration: Registration, liveness_s: float) -> RegisterResult:
        now = time.time()
        r = registration
        fp = r.fingerprint
        try:  # the ranks of a new job register at the same moment: the first insert wins
            with self._scope() as session:
                if (
                    session.scalars(sa.select(m.Job.id).where(m.Job.name == r.job)).one_or_none()
                    is None
                ):
                    session.add(
                        m.Job(
                            name=r.job,
                            world_size=r.world_size,
                            backend=r.backend,
                            model_digest=fp.digest,
                            parameter_count=fp.parameter_count,
                            parameter_bytes=fp.parameter_bytes,
                            tensor_count=fp.tensor_count,
                            largest_tensor_bytes=fp.largest_tensor_bytes,
                            median_tensor_bytes=fp.median_tensor_bytes,
                            created_at=now,
                            last_seen_at=now,
                            max_step=-1,
                            **_config_columns(r.config),
                            dropped_total=0,
                            tuning_disabled=r.tuning_disabled,
                            engine=r.engine,
                            **_memory_columns(r.memory),
                            collective_latency_s=r.collective_latency_s or None,
                            shard_layout=_layout_column(r.shard_layout),
                        )
                    )
        except AlreadyExists:
            pass
        with self._scope() as session:
            # Locked in the order every writer takes (job, then rank): a registration on one daemon
            # and a write of the same rank on another never interleave (no sample stored twice).
            job = self._job(session, r.job, lock=True)
            if job.world_size != r.world_size:
                raise FailedPrecondition(
                    f"job {r.job!r} is registered with world size {job.world_size}, not {r.world_size}; "
                    "use a new job id for a differently sized run"
                )
            if job.engine != r.engine:
                raise FailedPrecondition(
                    f"job {r.job!r} is registered as a {job.engine} job, not {r.engine}; use a new "
                    "job id (AUTOBYTE_JOB) for this run"
                )
            if fp.digest and job.model_digest and fp.digest != job.model_digest:
                raise FailedPrecondition(
                    f"job {r.job!r} is registered with a different model (digest {job.model_digest[:12]}, "
                    f"not {fp.digest[:12]}); use a new job id (AUTOBYTE_JOB) for this run"
                )
            if r.rank == 0:  # rank 0 decides for the job, as it does for the configuration
                job.tuning_disabled = r.tuning_disabled
                for name, value in _memory_columns(r.memory).items():
                    setattr(job, name, value)
                job.collective_latency_s = r.collective_latency_s or None
                job.shard_layout = _layout_column(r.shard_layout)
            rank = session.scalars(
                sa.select(m.Rank)
                .where(m.Rank.job_id == job.id, m.Rank.rank == r.rank)
                .with_for_update()
            ).one_or_none()
            session_id = uuid.uuid4().hex
            if rank is None:
                session.add(
                    m.Rank(
                        job_id=job.id,
                        rank=r.rank,
                        instance_id=r.instance_id,
                        session_id=session_id,
                        hostname=r.hostname,
                        pid=r.pid,
                        registered_at=now,
                        last_seen_at=now,
                        last_acked_seq=0,
                        dropped_total=0,
                    )
                )
                last_acked = 0
            elif rank.instance_id == r.instance_id:
                rank.session_id, rank.last_seen_at, rank.finished_at = session_id, now, None
                last_acked = rank.last_acked_seq
            elif rank.finished_at is None and now - rank.last_seen_at < liveness_s:
                raise AlreadyExists(
                    f"rank {r.rank} of job {r.job!r} is held by a live process (pid {rank.pid} on "
                    f"{rank.hostname}, seen {now - rank.last_seen_at:.1f}s ago); use another job id "
                    f"or wait {liveness_s:.0f}s after it stops"
                )
            else:  # a new process takes over a finished or silent rank; its samples start from seq 1
                rank.instance_id, rank.session_id, rank.hostname, rank.pid = (
                    r.instance_id,
                    session_id,
                    r.hostname,
                    r.pid,
                )
                rank.registered_at = rank.last_seen_at = now
                rank.last_acked_seq = rank.dropped_total = 0
                rank.finished_at = None
                last_acked = 0
                if r.rank == 0:
                    self._start_new_run(session, job)
            job.last_seen_at = now
        return RegisterResult(session_id=session_id, last_acked_seq=last_acked)

    @staticmethod
    def _start_new_run(session, job: m.Job) -> None:
        """A new process holds rank 0: a new run, whose steps count from 0 again. Decisions still
        pending were made for the previous run's step numbering: they expire, never to be replayed."""
        session.execute(
            sa.update(m.Decision)
            .where(m.Decision.job_id == job.id, m.Decision.state == "pending")
            .values(state="expired")
        )
        job.max_step = -1

    def append_samples(self, batches: Sequence[SampleBatch]) -> list[int]:
        """Returns per batch the stored high-water seq, or -1 when its session is not current."""
        now = time.time()
        acked: list[int] = []
        with self._scope() as session:
            # Every job row, then every rank row, each in id order and held to the end: the order
            # every writer takes (no deadlock between daemons), and a resend that another daemon
            # stores at the same moment sees this one's last_acked_seq (no sample stored twice).
            jobs = {
                job.name: job
                for job in session.scalars(
                    sa.select(m.Job)
                    .where(m.Job.name.in_(sorted({b.job for b in batches})))
                    .order_by(m.Job.id)
                    .with_for_update()
                )
            }
            wanted = sorted({(jobs[b.job].id, b.rank) for b in batches if b.job in jobs})
            ranks = (
                {
                    (rank.job_id, rank.rank): rank
                    for rank in session.scalars(
                        sa.select(m.Rank)
                        .where(sa.tuple_(m.Rank.job_id, m.Rank.rank).in_(wanted))
                        .order_by(m.Rank.id)
                        .with_for_update()
                    )
                }
                if wanted
                else {}
            )
            rows: list[dict] = []
            finished: set[int] = set()  # jobs a rank of which said goodbye in these batches
            for batch in batches:
                job = jobs.get(batch.job)
                rank = None if job is None else ranks.get((job.id, batch.rank))
                if rank is None or rank.session_id != batch.session_id:
                    acked.append(-1)
                    continue
                fresh = [(seq, s) for seq, s in batch.samples if seq > rank.last_acked_seq]
                rows += [
                    (job.id, batch.rank, *sample_row(s)) for _, s in fresh
                ]  # in SAMPLE_COLUMNS order
                if fresh:
                    rank.last_acked_seq = fresh[-1][0]
                    job.max_step = max(job.max_step, max(s.step for _, s in fresh))
                    if batch.rank == 0:
                        _set_config(job, fresh[-1][1].config)
                if batch.final:
                    rank.finished_at = now
                    finished.add(job.id)
                if batch.dropped_total > rank.dropped_total:
                    job.dropped_total += batch.dropped_total - rank.dropped_total
                    rank.dropped_total = batch.dropped_total
                rank.last_seen_at = job.last_seen_at = now
                acked.append(rank.last_acked_seq)
            if rows:
                _insert_samples(session.connection(), rows)
            session.flush()
            for job in jobs.values():
                if job.id in finished and self._finished_at(session, job) is not None:
                    # Every rank said goodbye: no process will apply what is still pending (the
                    # state is stored, so a daemon restarted on this database shows it too).
                    session.execute(
                        sa.update(m.Decision)
                        .where(m.Decision.job_id == job.id, m.Decision.state == "pending")
                        .values(state="expired")
                    )
        return acked

    # ------------------------------------------------------------------ control
    def record_applied_config(
        self, job: str, rank: int, decision_id: int, config: Config, applied_at_step: int
    ) -> None:
        with self._scope() as session:
            job_row = self._job(session, job)
            session.add(
                m.AppliedConfig(
                    job_id=job_row.id,
                    rank=rank,
                    decision_id=decision_id,
                    **_config_columns(config),
                    applied_at_step=applied_at_step,
                    reported_at=time.time(),
                )
            )
            if decision_id:
                decision = session.get(m.Decision, decision_id)
                if decision is None or decision.job_id != job_row.id:
                    raise NotFound(f"job {job!r} has no decision {decision_id}")
                if rank == 0:
                    decision.state, decision.applied_at_step = "applied", applied_at_step
            if rank == 0:
                _set_config(job_row, config)

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
        if state not in ("pending", "recommended"):
            raise ValueError(f"a new decision is pending or recommended, not {state!r}")
        if source == "operator":
            self._tuner_row(job)
        with self._scope() as session:
            # One decision of a job at a time, on every daemon: its ids are committed in order.
            job_row = self._job(session, job, lock=True)
            try:
                config.for_engine(job_row.engine)
            except ValueError as error:
                raise InvalidArgument(f"job {job!r}: {error}") from None
            memory = MemoryLimits.stored(job_row.memory_budget_bytes, job_row.over_budget)
            if memory is not None and not memory.allows(config):
                raise FailedPrecondition(f"job {job!r}: {memory.refusal(config)}")
            if lease_holder is not None:
                self._check_lease(session, tuner_lease(job), lease_holder)
            if source == "operator":
                self._refuse_if_finished(session, job_row)
            elif state == "pending" and self._finished_at(session, job_row) is not None:
                # The tuner decided from the job's last steps after its last rank said goodbye
                # (the goodbye expired what was pending then): no process will apply this one
                # either. Kept, as the tuner's record, expired.
                state = "expired"
            tuner = session.get(m.TunerState, job_row.id)
            if source == "operator":
                tuner.paused = True
                tuner.updated_at = time.time()
            elif tuner is not None and tuner.paused:
                raise FailedPrecondition(
                    f"the tuner is paused for job {job!r} (an operator decided); "
                    f"`autobyte tune {job} --resume` hands it back"
                )
            if state == "pending":
                session.execute(
                    sa.update(m.Decision)
                    .where(m.Decision.job_id == job_row.id, m.Decision.state == "pending")
                    .values(state="superseded")
                )
            row = m.Decision(
                job_id=job_row.id,
                **_config_columns(config),
                apply_at_step=apply_at_step,
                reason=reason,
                predicted_step_time_s=predicted_step_time_s,
                created_at=time.time(),
                state=state,
                source=source,
            )
            session.add(row)
            session.flush()
            return _decision(row, job)

    @staticmethod
    def _finished_at(session, job_row: m.Job) -> float | None:
        """When the last rank of the job said goodbye, if every rank it knows did; else None."""
        ranks, done, last = session.execute(
            sa.select(
                sa.func.count(), sa.func.count(m.Rank.finished_at), sa.func.max(m.Rank.finished_at)
            ).where(m.Rank.job_id == job_row.id)
        ).one()
        return last if ranks and ranks == done else None

    @classmethod
    def _refuse_if_finished(cls, session, job_row: m.Job) -> None:
        """FailedPrecondition when every rank of the job said goodbye: no process would ever apply a
        decision (a new run of the job expires what is pending anyway)."""
        last = cls._finished_at(session, job_row)
        if last is not None:
            when = time.strftime("%H:%M:%S", time.gmtime(last))
            raise FailedPrecondition(
                f"job {job_row.name!r} finished (every rank sent its last steps, the last "
                f"at {when} UTC): no process would apply the decision; propose it to "
                "a running job"
            )

    def close_decision(
        self, decision_id: int, measured_step_time_s: float | None, state: str | None = None
    ) -> None:
        with self._scope() as session:
            row = session.get(m.Decision, decision_id)
            if row is None:
                raise NotFound(f"no decision {decision_id}")
            if measured_step_time_s is not None:
                row.measured_step_time_s = measured_step_time_s
            if state is not None:
                row.state = state

    def _tuner_row(self, job: str) -> None:
        """Make sure the job has a tuner_states row; in a transaction of its own, because the
        tuner and an operator may create it at the same moment (the second insert loses, harmlessly)."""
        try:
            with self._scope() as session:
                job_id = self._job(session, job).id
                if session.get(m.TunerState, job_id) is None:
                    session.add(
                        m.TunerState(
                            job_id=job_id,
                            mode="",
                            state="",
                            detail="",
                            baseline_step_time_s=0.0,
                            measured_step_time_s=0.0,
                            predicted_step_time_s=0.0,
                            trials_done=0,
                            trials_planned=0,
                            paused=False,
                            updated_at=time.time(),
                        )
                    )
        except AlreadyExists:
            pass

    def decisions(self, job: str, after_decision_id: int = 0) -> list[DecisionRecord]:
        with self._scope() as session:
            job_row = self._job(session, job)
            rows = session.scalars(
                sa.select(m.Decision)
                .where(m.Decision.job_id == job_row.id, m.Decision.id > after_decision_id)
                .order_by(m.Decision.id)
            ).all()
            return [_decision(row, job) for row in rows]

    def newest_decision_ids(self, jobs: Sequence[str]) -> dict[str, int]:
        newest = (
            sa.select(sa.func.max(m.Decision.id))
            .where(m.Decision.job_id == m.Job.id)
            .scalar_subquery()
        )
        with self._scope() as session:
            rows = session.execute(
                sa.select(m.Job.name, newest).where(m.Job.name.in_(sorted(set(jobs))))
            ).all()
        return {name: decision_id or 0 for name, decision_id in rows}

    # ------------------------------------------------------------------ leases
    def _db_now(self):
        """The database's clock in seconds since the epoch (daemons on several hosts agree on it),
        or the lease_clock given."""
        if self._lease_clock is not None:
            return sa.literal(self._lease_clock(), sa.Float)
        dialect = self._engine.dialect.name
        if dialect == "postgresql":
            return sa.cast(sa.func.extract("epoch", sa.func.clock_timestamp()), sa.Float)
        if dialect == "sqlite":
            return (sa.func.julianday("now") - 2440587.5) * 86400.0
        return sa.literal(time.time())

    def acquire_lease(self, name: str, holder: str, duration_s: float) -> bool:
        if not duration_s > 0:
            raise ValueError(f"lease duration {duration_s!r} must be positive")
        now = self._db_now()
        with self._scope() as session:
            renewed = session.execute(
                sa.update(m.Lease)
                .where(
                    m.Lease.name == name, sa.or_(m.Lease.holder == holder, m.Lease.expires_at < now)
                )
                .values(
                    acquired_at=sa.case((m.Lease.holder == holder, m.Lease.acquired_at), else_=now),
                    holder=holder,
                    expires_at=now + duration_s,
                )
                .execution_options(synchronize_session=False)
            ).rowcount
        if renewed:
            return True
        try:
            with self._scope() as session:
                session.execute(
                    sa.insert(m.Lease).values(
                        name=name, holder=holder, acquired_at=now, expires_at=now + duration_s
                    )
                )
            return True
        except AlreadyExists:  # another daemon holds it (or took it this very moment)
            return False

    def release_lease(self, name: str, holder: str) -> None:
        with self._scope() as session:
            session.execute(
                sa.update(m.Lease)
                .where(m.Lease.name == name, m.Lease.holder == holder)
                .values(expires_at=0.0)
                .execution_options(synchronize_session=False)
            )

    def lease(self, name: str) -> LeaseRecord | None:
        with self._scope() as session:
            row = session.execute(
                sa.select(
                    m.Lease.holder, m.Lease.acquired_at, m.Lease.expires_at, self._db_now()
                ).where(m.Lease.name == name)
            ).one_or_none()
        if row is None:
            return None
        holder, acquired_at, expires_at, now = row
        return LeaseRecord(
            name=name, holder=holder, acquired_at_s=acquired_at, expires_in_s=expires_at - now
        )

    def _check_lease(self, session, name: str, holder: str) -> None:
        """FailedPrecondition unless `holder` holds the lease now. The row stays share-locked to the
        end of the transaction: a takeover waits until what this holder writes is committed."""
        row = session.execute(
            sa.select(m.Lease.holder, m.Lease.expires_at > self._db_now())
            .where(m.Lease.name == name)
            .with_for_update(read=True)
        ).one_or_none()
        if row is None or row[0] != holder or not row[1]:
            raise FailedPrecondition(
                f"lease {name!r} is not held by {holder}"
                + (f" (held by {row[0]})" if row is not None and row[1] else "")
            )

    # ------------------------------------------------------------------ query
    def jobs(self, running_within_s: float) -> list[JobRecord]:
        now = time.time()
        out = []
        with self._scope() as session:
            for job in session.scalars(sa.select(m.Job).order_by(m.Job.name)).all():
                rank_rows = session.execute(
                    sa.select(m.Rank.rank, m.Rank.finished_at)
                    .where(m.Rank.job_id == job.id)
                    .order_by(m.Rank.rank)
                ).all()
                ranks = tuple(rank for rank, _ in rank_rows)
                if rank_rows and all(finished is not None for _, finished in rank_rows):
                    state = "finished"  # every rank it knows said goodbye
                elif now - job.last_seen_at < running_within_s:
                    state = "running"
                else:
                    state = "idle"
                # the latest by wall time: a new run's steps count from 0 again
                recent = session.scalars(
                    sa.select(m.StepSample.step_time_s)
                    .where(m.StepSample.job_id == job.id, m.StepSample.rank == 0)
                    .order_by(m.StepSample.wall_time_s.desc())
                    .limit(20)
                ).all()
                last = session.scalars(
                    sa.select(m.Decision)
                    .where(m.Decision.job_id == job.id)
                    .order_by(m.Decision.id.desc())
                    .limit(1)
                ).one_or_none()
                tuner = session.get(m.TunerState, job.id)
                out.append(
                    JobRecord(
                        job=job.name,
                        state=state,
                        world_size=job.world_size,
                        backend=job.backend,
                        steps=job.max_step + 1,
                        config=_config(job),
                        ranks=ranks,
                        recent_step_time_s=statistics.median(recent) if recent else 0.0,
                        last_seen_s=job.last_seen_at,
                        dropped_total=job.dropped_total,
                        last_decision=_decision(last, job.name) if last else None,
                        tuner=_tuner_status(tuner) if tuner is not None and tuner.mode else None,
                        tuning_disabled=job.tuning_disabled,
                        engine=job.engine,
                    )
                )
        return out

    def history(
        self, job: str, since_s: float = 0.0, rank: int | None = None, limit: int = 1000
    ) -> list[HistoryStep]:
        with self._scope() as session:
            job_row = self._job(session, job)
            query = sa.select(m.StepSample.rank, *_METRIC_COLUMNS).where(
                m.StepSample.job_id == job_row.id, m.StepSample.wall_time_s >= since_s
            )
            if rank is not None:
                query = query.where(m.StepSample.rank == rank)
            rows = session.execute(
                query.order_by(m.StepSample.step.desc(), m.StepSample.rank.desc()).limit(limit)
            ).all()
            return [history_step(r[0], sample_from_row(r[1:])) for r in reversed(rows)]

    def rank0_points(self, job: str) -> list[StepPoint]:
        with self._scope() as session:
            job_row = self._job(session, job)
            rows = session.execute(
                sa.select(*_METRIC_COLUMNS)
                .where(m.StepSample.job_id == job_row.id, m.StepSample.rank == 0)
                .order_by(m.StepSample.wall_time_s, m.StepSample.id)
            ).all()
        return [
            StepPoint(
                s.step, s.wall_time_s, s.step_time_s, s.config, s.bandwidth_bytes_per_s, s.host_load
            )
            for s in map(sample_from_row, rows)
        ]

    # ------------------------------------------------------------------ maintenance
    def enforce_retention(self, max_raw_samples: int, keep_every: int) -> int:
        removed = 0
        jobs_to_trim: list[tuple[int, int]] = []
        with self._scope() as session:
            for job_id in session.scalars(sa.select(m.Job.id)).all():
                count = session.scalar(
                    sa.select(sa.func.count()).where(m.StepSample.job_id == job_id)
                )
                excess = count - max_raw_samples
                if excess <= 0:
                    continue
                # The oldest `excess` rows lose all but every keep_every-th step.
                cutoff = session.scalar(
                    sa.select(m.StepSample.id)
                    .where(m.StepSample.job_id == job_id)
                    .order_by(m.StepSample.id)
                    .offset(excess - 1)
                    .limit(1)
                )
                jobs_to_trim.append((job_id, cutoff))
        # Delete in short transactions so that the writer never waits long for the lock.
        for job_id, cutoff in jobs_to_trim:
            while True:
                with self._scope() as session:
                    chunk = (
                        sa.select(m.StepSample.id)
                        .where(
                            m.StepSample.job_id == job_id,
                            m.StepSample.id <= cutoff,
                            m.StepSample.step % keep_every != 0,
                        )
                        .limit(RETENTION_CHUNK_ROWS)
                        .scalar_subquery()
                    )
                    deleted = session.execute(
                        sa.delete(m.StepSample).where(m.StepSample.id.in_(chunk))
                    ).rowcount
                removed += deleted or 0
                if not deleted or deleted < RETENTION_CHUNK_ROWS:
                    break
        return removed

    def sample_count(self, job: str | None = None) -> int:
        with self._scope() as session:
            query = sa.select(sa.func.count()).select_from(m.StepSample)
            if job is not None:
                query = query.where(m.StepSample.job_id == self._job(session, job).id)
            return session.scalar(query)

    # ------------------------------------------------------------------ the tuner's
    def job_info(self, job: str) -> JobInfo:
        with self._scope() as session:
            row = self._job(session, job)
            return JobInfo(
                job=row.name,
                world_size=row.world_size,
                backend=row.backend,
                fingerprint=Fingerprint(
                    row.parameter_count,
                    row.parameter_bytes,
                    row.tensor_count,
                    row.largest_tensor_bytes,
                    row.median_tensor_bytes,
                    row.model_digest,
                ),
                tuning_disabled=row.tuning_disabled,
                engine=row.engine,
                memory=MemoryLimits.stored(row.memory_budget_bytes, row.over_budget),
                collective_latency_s=row.collective_latency_s or 0.0,
                shard_layout=ShardLayout.stored(row.shard_layout),
                created_at_s=row.created_at,
                last_seen_s=row.last_seen_at,
                finished_at_s=self._finished_at(session, row),
            )

    def active_jobs(self, seen_within_s: float) -> list[str]:
        with self._scope() as session:
            return list(
                session.scalars(
                    sa.select(m.Job.name)
                    .where(m.Job.last_seen_at >= time.time() - seen_within_s)
                    .order_by(m.Job.name)
                ).all()
            )

    def samples_after(
        self, job: str, after_row_id: int, rank: int | None = 0, limit: int = 10_000
    ) -> list[SampleRow]:
        with self._scope() as session:
            job_row = self._job(session, job)
            query = sa.select(m.StepSample.id, m.StepSample.rank, *_METRIC_COLUMNS).where(
                m.StepSample.job_id == job_row.id, m.StepSample.id > after_row_id
            )
            if rank is not None:
                query = query.where(m.StepSample.rank == rank)
            rows = session.execute(query.order_by(m.StepSample.id).limit(limit)).all()
            return [SampleRow(r[0], r[1], sample_from_row(r[2:])) for r in rows]

    def last_sample_row(self, job: str, rank: int | None = 0) -> int:
        with self._scope() as session:
            query = sa.select(sa.func.max(m.StepSample.id)).where(
                m.StepSample.job_id == self._job(session, job).id
            )
            if rank is not None:
                query = query.where(m.StepSample.rank == rank)
            return session.scalar(query) or 0

    def tuner_status(self, job: str) -> TunerStatusRecord | None:
        with self._scope() as session:
            row = session.get(m.TunerState, self._job(session, job).id)
            return _tuner_status(row) if row is not None else None

    def save_tuner_status(self, job: str, status: TunerStatusRecord) -> None:
        self._tuner_row(job)
        with self._scope() as session:
            row = session.get(m.TunerState, self._job(session, job).id)
            row.mode, row.state, row.detail = status.mode, status.state, status.detail
            _set_config(row, status.config)
            row.baseline_step_time_s = status.baseline_step_time_s
            row.measured_step_time_s = status.measured_step_time_s
            row.predicted_step_time_s = status.predicted_step_time_s
            row.trials_done, row.trials_planned = status.trials_done, status.trials_planned
            row.updated_at = status.updated_at_s or time.time()

    def set_tuning_paused(self, job: str, paused: bool) -> TunerStatusRecord:
        self._tuner_row(job)
        with self._scope() as session:
            row = session.get(m.TunerState, self._job(session, job).id)
            row.paused = paused
            row.updated_at = time.time()
            session.flush()
            return _tuner_status(row)

    def add_window(self, window: WindowRecord) -> int:
        with self._scope() as session:
            job_row = self._job(session, window.job)
            row = m.TunerWindow(
                job_id=job_row.id,
                segment=window.segment,
                created_at=window.created_at_s or time.time(),
                **_config_columns(window.config),
                step_time_s=window.step_time_s,
                samples=window.samples,
                context=window.context,
            )
            session.add(row)
            session.flush()
            return row.id

    def windows(
        self, after_window_id: int = 0, limit: int = 100_000, newest: bool = False
    ) -> list[WindowRecord]:
        with self._scope() as session:
            order = m.TunerWindow.id.desc() if newest else m.TunerWindow.id
            rows = session.execute(
                sa.select(m.TunerWindow, m.Job.name)
                .join(m.Job, m.Job.id == m.TunerWindow.job_id)
                .where(m.TunerWindow.id > after_window_id)
                .order_by(order)
                .limit(limit)
            ).all()
            if newest:
                rows = rows[::-1]
            return [
                WindowRecord(
                    job=name,
                    segment=w.segment,
                    config=_config(w),
                    step_time_s=w.step_time_s,
                    samples=w.samples,
                    context=w.context,
                    created_at_s=w.created_at,
                    window_id=w.id,
                )
                for w, name in rows
            ]

    def next_window_segment(self, job: str) -> int:
        with self._scope() as session:
            top = session.scalar(
                sa.select(sa.func.max(m.TunerWindow.segment))
                .join(m.Job, m.Job.id == m.TunerWindow.job_id)
                .where(m.Job.name == job)
            )
            return 0 if top is None else int(top) + 1

    def save_model(
        self, kind: str, model: bytes, examples: int, note: str = "", keep: int = 3
    ) -> int:
        with self._scope() as session:
            row = m.PredictorModel(
                created_at=time.time(), kind=kind, examples=examples, model=model, note=note
            )
            session.add(row)
            session.flush()
            old = session.scalars(
                sa.select(m.PredictorModel.id)
                .order_by(m.PredictorModel.id.desc())
                .offset(max(1, keep))
            ).all()
            if old:
                session.execute(sa.delete(m.PredictorModel).where(m.PredictorModel.id.in_(old)))
            return row.id

    def latest_model(self) -> ModelRecord | None:
        with self._scope() as session:
            row = session.scalars(
                sa.select(m.PredictorModel).order_by(m.PredictorModel.id.desc()).limit(1)
            ).one_or_none()
            if row is None:
                return None
            return ModelRecord(
                model_id=row.id,
                kind=row.kind,
                examples=row.examples,
                model=row.model,
                note=row.note,
                created_at_s=row.created_at,
            )
