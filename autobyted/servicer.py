"""gRPC servicers: telemetry in, control out, queries for the CLI (grpc.aio)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
from typing import Callable

import grpc

from autobyte import __version__
from autobyte.convert import config_from_proto, config_to_proto
from autobyte.protocol import autobyte_pb2 as pb
from autobyte.protocol import autobyte_pb2_grpc as pb_grpc
from autobyte.types import Config
from autobyte.channel import RETRY_AFTER_KEY
from autobyte.types import MAX_WORLD_SIZE
from autobyted.errors import FailedPrecondition, InvalidArgument, StorageError, status_for
from autobyted.ingest import IngestWriter, check_text_fields, validate_batch
from autobyted.observability import DaemonMetrics
from autobyted.settings import Settings
from autobyted.storage.base import BaseStorage
from autobyted.storage.records import DecisionRecord, Fingerprint, Registration, TunerStatusRecord

log = logging.getLogger(__name__)
RUNNING_WITHIN_S = 30.0
# Batches with more samples than this are validated on a worker thread, and History answers with
# more steps than this are built on one, so that the event loop keeps serving every other stream.
INLINE_ROWS = 256
# Longest strings a registration may carry (the columns that store them).
MAX_FIELD_CHARS = {"job": 255, "backend": 32, "instance_id": 128, "hostname": 255}


def _abort_on_error(metrics: DaemonMetrics):
    """Turn any exception of a handler into a gRPC status via errors.status_for."""

    def decorate(method: Callable):
        async def report(error: BaseException, context) -> None:
            code, message = status_for(error)
            if isinstance(error, StorageError):
                log.error("%s failed: %s", method.__name__, message)
            elif code == grpc.StatusCode.INTERNAL:
                log.exception("internal error in %s", method.__name__)
            metrics.rpc_errors.labels(code.name).inc()
            retry_after_ms = getattr(error, "retry_after_ms", None)
            trailing = ((RETRY_AFTER_KEY, str(retry_after_ms)),) if retry_after_ms is not None else ()
            await context.abort(code, message, trailing_metadata=trailing)

        if inspect.isasyncgenfunction(method):
            @functools.wraps(method)
            async def stream_wrapper(self, request, context):
                try:
                    if hasattr(request, "ListFields"):  # not a request stream
                        check_text_fields(request)
                    async for item in method(self, request, context):
                        yield item
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as error:
                    await report(error, context)
            return stream_wrapper

        @functools.wraps(method)
        async def wrapper(self, request, context):
            try:
                if hasattr(request, "ListFields"):  # not a request stream
                    check_text_fields(request)
                return await method(self, request, context)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as error:
                await report(error, context)
        return wrapper

    return decorate


def decision_to_proto(record: DecisionRecord) -> pb.Decision:
    message = pb.Decision(decision_id=record.decision_id, job=record.job, config=config_to_proto(record.config),
                          apply_at_step=record.apply_at_step, reason=record.reason,
                          created_at_s=record.created_at_s, state=record.state, source=record.source)
    for name in ("predicted_step_time_s", "measured_step_time_s", "applied_at_step"):
        if getattr(record, name) is not None:
            setattr(message, name, getattr(record, name))
    return message


def tuner_status_to_proto(record: TunerStatusRecord, daemon_mode: str) -> pb.TunerStatus:
    """A stored tuner state; with the daemon's --tuner off, whatever was stored is history."""
    if daemon_mode == "off" and record.mode in ("auto", "observe"):
        return pb.TunerStatus(mode="off", state="off", detail="off: autobyted runs with --tuner off",
                              paused=record.paused, known=True, updated_at_s=record.updated_at_s)
    return pb.TunerStatus(mode=record.mode or daemon_mode,
                          state=record.state or ("paused" if record.paused else "waiting"),
                          detail=record.detail or ("paused by an operator" if record.paused else ""),
                          config=config_to_proto(record.config), baseline_step_time_s=record.baseline_step_time_s,
                          measured_step_time_s=record.measured_step_time_s,
                          predicted_step_time_s=record.predicted_step_time_s, paused=record.paused,
                          trials_done=record.trials_done, trials_planned=record.trials_planned,
                          updated_at_s=record.updated_at_s, known=bool(record.mode))


def resumed_status(record: TunerStatusRecord) -> TunerStatusRecord:
    """What a resume answers before the tuner has acted on it: the stored state is still the
    pause's, whose reason must not be repeated as if it held."""
    if record.state != "paused" and not record.detail.startswith("paused"):
        return record
    return dataclasses.replace(record, state="resuming",
                               detail="resuming: the tuner measures the configuration in effect, then "
                                      "searches from it")


class DecisionHub:
    """Wakes WatchConfig streams of a job when a decision is stored: at once for this daemon's own
    decisions, within one poll (decision_poll_loop) for those of another daemon on the database."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[asyncio.Event]] = {}

    def watched_jobs(self) -> list[str]:
        return [job for job, waiters in self._waiters.items() if waiters]

    def subscribe(self, job: str) -> asyncio.Event:
        event = asyncio.Event()
        self._waiters.setdefault(job, set()).add(event)
        return event

    def unsubscribe(self, job: str, event: asyncio.Event) -> None:
        waiters = self._waiters.get(job)
        if waiters is not None:
            waiters.discard(event)
            if not waiters:
                del self._waiters[job]

    def publish(self, job: str) -> None:
        for event in self._waiters.get(job, ()):
            event.set()


class Services(pb_grpc.TelemetryServicer, pb_grpc.ControlServicer, pb_grpc.QueryServicer):
    """All three services over one storage; one instance per daemon."""

    def __init__(self, storage: BaseStorage, writer: IngestWriter, settings: Settings,
                 metrics: DaemonMetrics, wake_tuner: Callable[[list[str]], None] | None = None) -> None:
        self._storage = storage
        self._writer = writer
        self._settings = settings
        self._metrics = metrics
        self.hub = DecisionHub()
        self._wake_tuner = wake_tuner or (lambda jobs: None)
        self.loop: asyncio.AbstractEventLoop | None = None  # the daemon's loop (app.py sets it)
        wrap = _abort_on_error(metrics)
        for name in ("Register", "StreamMetrics", "WatchConfig", "ReportConfig", "ProposeConfig", "SetTuning",
                     "Status", "History", "Best"):
            setattr(self, name, wrap(getattr(type(self), name)).__get__(self))

    async def _call(self, fn, *args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)

    # ------------------------------------------------------------------ telemetry
    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        if not request.job:
            raise InvalidArgument("job id must be 1 to 255 characters")
        for name, limit in MAX_FIELD_CHARS.items():
            if len(getattr(request, name)) > limit:
                raise InvalidArgument(f"{name} must be at most {limit} characters, got {len(getattr(request, name))}")
        if not 1 <= request.world_size <= MAX_WORLD_SIZE:
            raise InvalidArgument(f"world size {request.world_size} is outside [1, {MAX_WORLD_SIZE}]")
        if not 0 <= request.rank < request.world_size:
            raise InvalidArgument(f"rank {request.rank} is not within world size {request.world_size}")
        if not request.instance_id:
            raise InvalidArgument("registration without an instance id")
        if request.HasField("data_parallel_size"):
            dp_rank, dp_size, leader = (request.data_parallel_rank, request.data_parallel_size,
                                        request.data_parallel_leader)
            if not (1 <= dp_size <= request.world_size and 0 <= dp_rank < dp_size
                    and 0 <= leader < request.world_size):
                raise InvalidArgument(f"data-parallel rank {dp_rank} of {dp_size} (leader {leader}) does not "
                                      f"fit world size {request.world_size}")
        fp = request.model
        registration = Registration(
            job=request.job, rank=request.rank, world_size=request.world_size, backend=request.backend or "unknown",
            instance_id=request.instance_id, hostname=request.hostname, pid=request.pid,
            fingerprint=Fingerprint(fp.parameter_count, fp.parameter_bytes, fp.tensor_count,
                                    fp.largest_tensor_bytes, fp.median_tensor_bytes, fp.digest),
            config=config_from_proto(request.config), tuning_disabled=request.tuning_disabled)
        result = await self._call(self._storage.register, registration, self._settings.rank_liveness_s)
        log.info("rank registered", extra={"job": request.job, "rank": request.rank,
                                           "data_parallel_rank": request.data_parallel_rank,
                                           "data_parallel_size": request.data_parallel_size,
                                           "data_parallel_leader": request.data_parallel_leader,
                                           "last_acked_seq": result.last_acked_seq})
        return pb.RegisterResponse(session_id=result.session_id, last_acked_seq=result.last_acked_seq)

    async def StreamMetrics(self, request_iterator, context):
        self._metrics.streams.labels("telemetry").inc()
        try:
            async for batch in request_iterator:
                try:
                    if len(batch.samples) > INLINE_ROWS:
                        clean = await self._call(validate_batch, batch, self._settings.max_samples_per_batch)
                    else:
                        clean = validate_batch(batch, self._settings.max_samples_per_batch)
                except InvalidArgument:
                    self._metrics.samples_rejected.inc(len(batch.samples))
                    raise
                acked = await asyncio.wrap_future(self._writer.submit(clean))  # or Overloaded
                if acked < 0:
                    raise FailedPrecondition(
                        f"session {batch.session_id!r} is not the current registration of job {batch.job!r} "
                        f"rank {batch.rank}; register again")
                yield pb.MetricsAck(acked_seq=acked)
        finally:
            self._metrics.streams.labels("telemetry").dec()

    # ------------------------------------------------------------------ control
    async def WatchConfig(self, request: pb.WatchConfigRequest, context):
        await self._call(self._storage.decisions, request.job, 2**62)  # NotFound for an unknown job
        event = self.hub.subscribe(request.job)
        self._metrics.streams.labels("control").inc()
        after = request.after_decision_id
        try:
            while True:
                event.clear()
                for record in await self._call(self._storage.decisions, request.job, after):
                    after = record.decision_id
                    # Only a pending decision is news: an applied or superseded one belongs to the
                    # past (or to an earlier run of the job) and must not be replayed.
                    if record.state == "pending":
                        yield pb.ConfigUpdate(job=record.job, decision_id=record.decision_id,
                                              config=config_to_proto(record.config),
                                              apply_at_step=record.apply_at_step, reason=record.reason)
                await event.wait()
        finally:
            self.hub.unsubscribe(request.job, event)
            self._metrics.streams.labels("control").dec()

    async def ReportConfig(self, request: pb.ReportConfigRequest, context) -> pb.ReportConfigResponse:
        config = config_from_proto(request.config)
        if request.applied_at_step < 0:
            raise InvalidArgument(f"applied_at_step={request.applied_at_step} must not be negative")
        await self._call(self._storage.record_applied_config, request.job, request.rank, request.decision_id,
                         config, request.applied_at_step)
        return pb.ReportConfigResponse()

    async def ProposeConfig(self, request: pb.ProposeConfigRequest, context) -> pb.Decision:
        config = config_from_proto(request.config)
        if request.apply_at_step < 0:
            raise InvalidArgument(f"apply_at_step={request.apply_at_step} must not be negative")
        record = await self.decide(request.job, config, request.apply_at_step, request.reason or "operator request",
                                   source="operator")
        self._wake_tuner([request.job])  # the operator's word pauses the tuner for this job
        return decision_to_proto(record)

    async def SetTuning(self, request: pb.SetTuningRequest, context) -> pb.TunerStatus:
        status = await self._call(self._storage.set_tuning_paused, request.job, request.paused)
        self._wake_tuner([request.job])
        log.info("tuning paused" if request.paused else "tuning resumed", extra={"job": request.job})
        return tuner_status_to_proto(resumed_status(status) if not request.paused else status,
                                     self._settings.tuner)

    async def decide(self, job: str, config: Config, apply_at_step: int, reason: str,
                     predicted_step_time_s: float | None = None, *, source: str = "tuner",
                     state: str = "pending", lease_holder: str | None = None) -> DecisionRecord:
        """Store a decision and wake the job's control streams (also the tuner's way out). A
        "recommended" decision (the tuner in observe mode) is stored and never pushed. With
        lease_holder (the tuner's), only while that daemon holds the job's tuner lease."""
        record = await self._call(self._storage.add_decision, job, config, apply_at_step, reason,
                                  predicted_step_time_s, source, state, lease_holder)
        self._metrics.decisions.inc()
        if state == "pending":
            self.hub.publish(job)
        log.info("decision", extra={"job": job, "decision_id": record.decision_id, "config": config.describe(),
                                    "reason": reason, "source": source, "state": state})
        return record

    def decide_from_thread(self, job: str, config: Config, apply_at_step: int, reason: str,
                           predicted_step_time_s: float | None = None, *, source: str = "tuner",
                           state: str = "pending", lease_holder: str | None = None,
                           timeout_s: float = 10.0) -> DecisionRecord:
        """`decide` for the tuner's worker thread: runs the coroutine on the daemon's event loop."""
        if self.loop is None:
            raise RuntimeError("Services.loop is not set: the daemon is not running")
        future = asyncio.run_coroutine_threadsafe(
            self.decide(job, config, apply_at_step, reason, predicted_step_time_s, source=source, state=state,
                        lease_holder=lease_holder),
            self.loop)
        return future.result(timeout_s)

    # ------------------------------------------------------------------ query
    async def Status(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        jobs = await self._call(self._storage.jobs, RUNNING_WITHIN_S)
        response = pb.StatusResponse(daemon_version=__version__)
        for job in jobs:
            status = response.jobs.add(
                job=job.job, state=job.state, world_size=job.world_size, steps=job.steps,
                config=config_to_proto(job.config), ranks=job.ranks, backend=job.backend,
                recent_step_time_s=job.recent_step_time_s,
                recent_steps_per_s=1.0 / job.recent_step_time_s if job.recent_step_time_s else 0.0,
                last_seen_s=job.last_seen_s, dropped_total=job.dropped_total,
                has_last_decision=job.last_decision is not None)
            status.tuner.CopyFrom(self._tuner_of(job))
            if job.last_decision is not None:
                status.last_decision.CopyFrom(decision_to_proto(job.last_decision))
        return response

    def _tuner_of(self, job) -> pb.TunerStatus:
        mode = self._settings.tuner
        if job.tuner is not None:
            return tuner_status_to_proto(job.tuner, mode)
        if mode == "off":
            return pb.TunerStatus(mode="off", state="off", detail="off: autobyted runs with --tuner off")
        if job.tuning_disabled:
            return pb.TunerStatus(mode="opted out", state="off",
                                  detail="off: the job opted out (autobyte.init(tune=False))")
        return pb.TunerStatus(mode=mode, state="waiting", detail="waiting for the job's first steps")

    async def History(self, request: pb.HistoryRequest, context) -> pb.HistoryResponse:
        if request.limit < 0:
            raise InvalidArgument(f"limit={request.limit} must not be negative")
        rank = request.rank if request.HasField("rank") else None
        limit = min(request.limit or 1000, 100_000)
        steps = await self._call(self._storage.history, request.job, request.since_s, rank, limit)
        decisions = await self._call(self._storage.decisions, request.job, 0)
        if len(steps) > INLINE_ROWS:
            return await self._call(history_to_proto, request, steps, decisions)
        return history_to_proto(request, steps, decisions)

    async def Best(self, request: pb.BestRequest, context) -> pb.BestResponse:
        best = await self._call(self._storage.best, request.job)
        response = pb.BestResponse(job=best.job, found=best.found, config=config_to_proto(best.config),
                                   median_step_time_s=best.median_step_time_s, samples=best.samples,
                                   baseline_step_time_s=best.baseline_step_time_s, evidence=best.evidence,
                                   context=best.context, reference=config_to_proto(best.reference),
                                   reference_step_time_s=best.reference_step_time_s, contexts=best.contexts)
        for candidate in best.candidates:
            response.candidates.add(config=config_to_proto(candidate.config), samples=candidate.samples,
                                    median_step_time_s=candidate.median_step_time_s, speedup=candidate.speedup)
        return response


def history_to_proto(request: pb.HistoryRequest, steps, decisions) -> pb.HistoryResponse:
    response = pb.HistoryResponse(job=request.job)
    for record in steps:
        response.steps.add(step=record.step, rank=record.rank, wall_time_s=record.wall_time_s,
                           step_time_s=record.step_time_s, exposed_comm_s=record.exposed_comm_s,
                           bytes_reduced=record.bytes_reduced, config=config_to_proto(record.config),
                           forward_s=record.forward_s, backward_s=record.backward_s,
                           bandwidth_bytes_per_s=record.bandwidth_bytes_per_s, host_load=record.host_load,
                           decision_id=record.decision_id)
    response.decisions.extend(decision_to_proto(d) for d in decisions if d.created_at_s >= request.since_s)
    return response


RETENTION_LEASE = "retention"


async def retention_loop(storage: BaseStorage, settings: Settings, holder: str, interval_s: float = 60.0) -> None:
    """Bound raw samples per job (downsampling the oldest) for as long as the daemon runs. Of the
    daemons sharing a database, the one holding the retention lease does it (kept while it runs)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            if not await asyncio.to_thread(storage.acquire_lease, RETENTION_LEASE, holder, 3 * interval_s):
                continue
            removed = await asyncio.to_thread(storage.enforce_retention, settings.retention_raw_samples,
                                              settings.downsample_every)
            if removed:
                log.info("retention downsampled samples", extra={"removed": removed})
        except Exception as error:  # keep serving; the next round tries again
            log.warning("retention pass failed: %s", error)


async def decision_poll_loop(storage: BaseStorage, hub: DecisionHub, interval_s: float) -> None:
    """Every interval_s, wake the control streams of the watched jobs whose newest decision changed:
    decisions stored by another daemon on the same database reach this daemon's ranks within one
    interval (one indexed query per interval, however many streams). A job seen for the first time
    is woken too: a decision may have landed between its stream's first read and this poll."""
    known: dict[str, int] = {}
    while True:
        await asyncio.sleep(interval_s)
        jobs = hub.watched_jobs()
        known = {job: known[job] for job in jobs if job in known}
        if not jobs:
            continue
        try:
            newest = await asyncio.to_thread(storage.newest_decision_ids, jobs)
        except Exception as error:  # keep polling; the streams still see this daemon's own decisions
            log.warning("polling for decisions failed: %s", error)
            continue
        for job, decision_id in newest.items():
            if known.get(job) != decision_id:
                known[job] = decision_id
                hub.publish(job)
