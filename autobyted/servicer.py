"""gRPC servicers, one per service (telemetry in, control out, queries for the CLI; grpc.aio), over one
ServiceContext; the Decider stores decisions (the operator's and the tuner's). Hub and loops: `hub`."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable
from typing import NamedTuple

import grpc
from autobyte import __version__
from autobyte.channel import RETRY_AFTER_KEY
from autobyte.convert import (
    best_to_proto,
    config_from_proto,
    config_update_to_proto,
    decision_to_proto,
    history_to_proto,
    job_status_to_proto,
    registration_from_proto,
    tuner_status_to_proto,
)
from autobyte.protocol import autobyte_pb2 as pb
from autobyte.protocol import autobyte_pb2_grpc as pb_grpc
from autobyte.types import MAX_WORLD_SIZE, Config

from autobyted import best as best_mod
from autobyted.errors import FailedPrecondition, InvalidArgument, StorageError, status_for
from autobyted.hub import DecisionHub
from autobyted.ingest import IngestWriter, check_text_fields, validate_batch
from autobyted.observability import DaemonMetrics
from autobyted.settings import Settings
from autobyted.storage.base import BaseStorage
from autobyted.storage.records import DecisionRecord, TunerStatusRecord
from autobyted.tuner.eligible import not_tuned

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
            trailing = (
                ((RETRY_AFTER_KEY, str(retry_after_ms)),) if retry_after_ms is not None else ()
            )
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
                except Exception as error:  # noqa: BLE001 - every other error becomes the call's gRPC status
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
            except Exception as error:  # noqa: BLE001 - every other error becomes the call's gRPC status
                await report(error, context)

        return wrapper

    return decorate


def tuner_status_for(record: TunerStatusRecord, daemon_mode: str) -> pb.TunerStatus:
    """A stored tuner state; with the daemon's --tuner off, whatever was stored is history."""
    if daemon_mode == "off" and record.mode in ("auto", "observe"):
        return tuner_status_to_proto(
            TunerStatusRecord(
                mode="off",
                state="off",
                detail="off: autobyted runs with --tuner off",
                paused=record.paused,
                updated_at_s=record.updated_at_s,
            ),
            with_config=False,
        )
    return tuner_status_to_proto(
        dataclasses.replace(
            record,
            mode=record.mode or daemon_mode,
            state=record.state or ("paused" if record.paused else "waiting"),
            detail=record.detail or ("paused by an operator" if record.paused else ""),
        ),
        known=bool(record.mode),
    )


def resumed_status(record: TunerStatusRecord) -> TunerStatusRecord:
    """What a resume answers before the tuner has acted on it: the stored state is still the
    pause's, whose reason must not be repeated as if it held."""
    if record.state != "paused" and not record.detail.startswith("paused"):
        return record
    return dataclasses.replace(
        record,
        state="resuming",
        detail="resuming: the tuner measures the configuration in effect, then searches from it",
    )


@dataclasses.dataclass(frozen=True)
class ServiceContext:
    """What the three servicers and the decider share; one per daemon."""

    storage: BaseStorage
    writer: IngestWriter
    settings: Settings
    metrics: DaemonMetrics
    hub: DecisionHub
    wake_tuner: Callable[[list[str]], None]


class _Servicer:
    """Base of a servicer: its RPCS wrapped by _abort_on_error, the shared parts as attributes."""

    RPCS: tuple[str, ...] = ()

    def __init__(self, context: ServiceContext) -> None:
        self._storage = context.storage
        self._writer = context.writer
        self._settings = context.settings
        self._metrics = context.metrics
        self.hub = context.hub
        self._wake_tuner = context.wake_tuner
        wrap = _abort_on_error(context.metrics)
        for name in self.RPCS:
            setattr(self, name, wrap(getattr(type(self), name)).__get__(self))

    async def _call(self, fn, *args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)


class TelemetryService(_Servicer, pb_grpc.TelemetryServicer):
    """Registrations and metric streams in."""

    RPCS = ("Register", "StreamMetrics")

    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        if not request.job:
            raise InvalidArgument("job id must be 1 to 255 characters")
        for name, limit in MAX_FIELD_CHARS.items():
            if len(getattr(request, name)) > limit:
                raise InvalidArgument(
                    f"{name} must be at most {limit} characters, got {len(getattr(request, name))}"
                )
        if not 1 <= request.world_size <= MAX_WORLD_SIZE:
            raise InvalidArgument(
                f"world size {request.world_size} is outside [1, {MAX_WORLD_SIZE}]"
            )
        if not 0 <= request.rank < request.world_size:
            raise InvalidArgument(
                f"rank {request.rank} is not within world size {request.world_size}"
            )
        if not request.instance_id:
            raise InvalidArgument("registration without an instance id")
        if request.HasField("data_parallel_size"):
            dp_rank, dp_size, leader = (
                request.data_parallel_rank,
                request.data_parallel_size,
                request.data_parallel_leader,
            )
            if not (
                1 <= dp_size <= request.world_size
                and 0 <= dp_rank < dp_size
                and 0 <= leader < request.world_size
            ):
                raise InvalidArgument(
                    f"data-parallel rank {dp_rank} of {dp_size} (leader {leader}) does not "
                    f"fit world size {request.world_size}"
                )
        registration = registration_from_proto(request)
        result = await self._call(
            self._storage.register, registration, self._settings.rank_liveness_s
        )
        log.info(
            "rank registered",
            extra={
                "job": request.job,
                "rank": request.rank,
                "data_parallel_rank": request.data_parallel_rank,
                "data_parallel_size": request.data_parallel_size,
                "data_parallel_leader": request.data_parallel_leader,
                "last_acked_seq": result.last_acked_seq,
            },
        )
        return pb.RegisterResponse(
            session_id=result.session_id, last_acked_seq=result.last_acked_seq
        )

    async def StreamMetrics(self, request_iterator, context):
        self._metrics.streams.labels("telemetry").inc()
        try:
            async for batch in request_iterator:
                try:
                    if len(batch.samples) > INLINE_ROWS:
                        clean = await self._call(
                            validate_batch, batch, self._settings.max_samples_per_batch
                        )
                    else:
                        clean = validate_batch(batch, self._settings.max_samples_per_batch)
                except InvalidArgument:
                    self._metrics.samples_rejected.inc(len(batch.samples))
                    raise
                acked = await asyncio.wrap_future(self._writer.submit(clean))  # or Overloaded
                if acked < 0:
                    raise FailedPrecondition(
                        f"session {batch.session_id!r} is not the current registration of job {batch.job!r} "
                        f"rank {batch.rank}; register again"
                    )
                yield pb.MetricsAck(acked_seq=acked)
        finally:
            self._metrics.streams.labels("telemetry").dec()


class Decider:
    """Stores decisions and wakes the job's control streams: the operator's (ControlService) and
    the tuner's (decide_from_thread) one way out."""

    def __init__(self, context: ServiceContext) -> None:
        self._storage = context.storage
        self._metrics = context.metrics
        self.hub = context.hub
        self.loop: asyncio.AbstractEventLoop | None = None  # the daemon's loop (app.py sets it)

    async def _call(self, fn, *args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def decide(
        self,
        job: str,
        config: Config,
        apply_at_step: int,
        reason: str,
        predicted_step_time_s: float | None = None,
        *,
        source: str = "tuner",
        state: str = "pending",
        lease_holder: str | None = None,
    ) -> DecisionRecord:
        """Store a decision and wake the job's control streams (also the tuner's way out). A
        "recommended" decision (the tuner in observe mode) is stored and never pushed. With
        lease_holder (the tuner's), only while that daemon holds the job's tuner lease."""
        record = await self._call(
            self._storage.add_decision,
            job,
            config,
            apply_at_step,
            reason,
            predicted_step_time_s,
            source,
            state,
            lease_holder,
        )
        self._metrics.decisions.inc()
        if state == "pending":
            self.hub.publish(job)
        log.info(
            "decision",
            extra={
                "job": job,
                "decision_id": record.decision_id,
                "config": config.describe(),
                "reason": reason,
                "source": source,
                "state": state,
            },
        )
        return record

    def decide_from_thread(
        self,
        job: str,
        config: Config,
        apply_at_step: int,
        reason: str,
        predicted_step_time_s: float | None = None,
        *,
        source: str = "tuner",
        state: str = "pending",
        lease_holder: str | None = None,
        timeout_s: float = 10.0,
    ) -> DecisionRecord:
        """`decide` for the tuner's worker thread: runs the coroutine on the daemon's event loop."""
        if self.loop is None:
            raise RuntimeError("Decider.loop is not set: the daemon is not running")
        future = asyncio.run_coroutine_threadsafe(
            self.decide(
                job,
                config,
                apply_at_step,
                reason,
                predicted_step_time_s,
                source=source,
                state=state,
                lease_holder=lease_holder,
            ),
            self.loop,
        )
        return future.result(timeout_s)


class ControlService(_Servicer, pb_grpc.ControlServicer):
    """Configuration updates out, applied configurations back, operator proposals and pauses."""

    RPCS = ("WatchConfig", "ReportConfig", "ProposeConfig", "SetTuning")

    def __init__(self, context: ServiceContext, decider: Decider) -> None:
        super().__init__(context)
        self._decider = decider

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
                        yield config_update_to_proto(record)
                await event.wait()
        finally:
            self.hub.unsubscribe(request.job, event)
            self._metrics.streams.labels("control").dec()

    async def ReportConfig(
        self, request: pb.ReportConfigRequest, context
    ) -> pb.ReportConfigResponse:
        config = config_from_proto(request.config)
        if request.applied_at_step < 0:
            raise InvalidArgument(f"applied_at_step={request.applied_at_step} must not be negative")
        await self._call(
            self._storage.record_applied_config,
            request.job,
            request.rank,
            request.decision_id,
            config,
            request.applied_at_step,
        )
        return pb.ReportConfigResponse()

    async def ProposeConfig(self, request: pb.ProposeConfigRequest, context) -> pb.Decision:
        config = config_from_proto(request.config)
        if request.apply_at_step < 0:
            raise InvalidArgument(f"apply_at_step={request.apply_at_step} must not be negative")
        record = await self._decider.decide(
            request.job,
            config,
            request.apply_at_step,
            request.reason or "operator request",
            source="operator",
        )
        self._wake_tuner([request.job])  # the operator's word pauses the tuner for this job
        return decision_to_proto(record)

    async def SetTuning(self, request: pb.SetTuningRequest, context) -> pb.TunerStatus:
        status = await self._call(self._storage.set_tuning_paused, request.job, request.paused)
        self._wake_tuner([request.job])
        log.info(
            "tuning paused" if request.paused else "tuning resumed", extra={"job": request.job}
        )
        return tuner_status_for(
            resumed_status(status) if not request.paused else status, self._settings.tuner
        )


class QueryService(_Servicer, pb_grpc.QueryServicer):
    """Status, history and best configuration, for the CLI."""

    RPCS = ("Status", "History", "Best")

    async def Status(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        jobs = await self._call(self._storage.jobs, RUNNING_WITHIN_S)
        response = pb.StatusResponse(daemon_version=__version__)
        response.jobs.extend(job_status_to_proto(job, self._tuner_of(job)) for job in jobs)
        return response

    def _tuner_of(self, job) -> pb.TunerStatus:
        mode = self._settings.tuner
        if job.tuner is not None:
            return tuner_status_for(job.tuner, mode)
        if mode == "off":
            return tuner_status_to_proto(
                TunerStatusRecord(
                    mode="off", state="off", detail="off: autobyted runs with --tuner off"
                ),
                known=False,
                with_config=False,
            )
        status = not_tuned(job.tuning_disabled, job.engine)
        if status is not None:
            return tuner_status_to_proto(
                dataclasses.replace(status, updated_at_s=0.0), known=False, with_config=False
            )
        return tuner_status_to_proto(
            TunerStatusRecord(
                mode=mode, state="waiting", detail="waiting for the job's first steps"
            ),
            known=False,
            with_config=False,
        )

    async def History(self, request: pb.HistoryRequest, context) -> pb.HistoryResponse:
        if request.limit < 0:
            raise InvalidArgument(f"limit={request.limit} must not be negative")
        rank = request.rank if request.HasField("rank") else None
        limit = min(request.limit or 1000, 100_000)
        steps = await self._call(self._storage.history, request.job, request.since_s, rank, limit)
        decisions = [
            d
            for d in await self._call(self._storage.decisions, request.job, 0)
            if d.created_at_s >= request.since_s
        ]
        if len(steps) > INLINE_ROWS:
            return await self._call(history_to_proto, request.job, steps, decisions)
        return history_to_proto(request.job, steps, decisions)

    async def Best(self, request: pb.BestRequest, context) -> pb.BestResponse:
        best = await self._call(best_mod.best, self._storage, request.job)
        return best_to_proto(best)


class Services(NamedTuple):
    """The daemon's servicers and what it wires to them (app.py: the loop, the tuner, the poll)."""

    telemetry: TelemetryService
    control: ControlService
    query: QueryService
    decider: Decider
    hub: DecisionHub


def make_services(
    storage: BaseStorage,
    writer: IngestWriter,
    settings: Settings,
    metrics: DaemonMetrics,
    wake_tuner: Callable[[list[str]], None] | None = None,
) -> Services:
    """One servicer per service over one storage, sharing a ServiceContext; starts nothing."""
    context = ServiceContext(
        storage, writer, settings, metrics, DecisionHub(), wake_tuner or (lambda jobs: None)
    )
    decider = Decider(context)
    return Services(
        TelemetryService(context),
        ControlService(context, decider),
        QueryService(context),
        decider,
        context.hub,
    )
