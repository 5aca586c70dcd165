"""The one place where protocol messages turn into plain frozen values and back."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable

from autobyte.protocol import autobyte_pb2 as pb
from autobyte.records import (
    MAX_OVER_BUDGET,
    MAX_SHARD_GROUPS,
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
from autobyte.types import ENGINES, Config, StepMetrics

# StepMetrics' fields that map one to one onto the message's (every sample goes through here: the
# daemon converts tens of thousands a second, so this is computed once).
_METRIC_FIELDS = tuple(f.name for f in dataclasses.fields(StepMetrics) if f.name != "config")
# Config's fields are the message's optional fields of the same names (unset: None).
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(Config))
# HistoryStep's fields map one to one onto StepRecord's, its config as a message.
_HISTORY_FIELDS = tuple(f.name for f in dataclasses.fields(HistoryStep) if f.name != "config")


def config_to_proto(config: Config) -> pb.Config:
    return pb.Config(
        **{name: value for name in _CONFIG_FIELDS if (value := getattr(config, name)) is not None}
    )


def config_from_proto(message: pb.Config) -> Config:
    """Raises ValueError for values outside the safe limits."""
    return _config(
        *(getattr(message, name) if message.HasField(name) else None for name in _CONFIG_FIELDS)
    )


@functools.lru_cache(maxsize=1024)
def _config(*values: int | None) -> Config:
    """Config is frozen: the few configurations a job runs are validated once (a ValueError is not cached)."""
    return Config(*values)


def metrics_to_proto(metrics: StepMetrics, seq: int) -> pb.StepMetrics:
    fields = {name: getattr(metrics, name) for name in _METRIC_FIELDS}
    return pb.StepMetrics(seq=seq, config=config_to_proto(metrics.config), **fields)


def metrics_from_proto(message: pb.StepMetrics) -> tuple[int, StepMetrics]:
    """(seq, metrics). Raises ValueError on a bad configuration; value checks are the daemon's."""
    fields = {name: getattr(message, name) for name in _METRIC_FIELDS}
    return message.seq, StepMetrics(config=config_from_proto(message.config), **fields)


def fingerprint_to_proto(fingerprint: Fingerprint) -> pb.ModelFingerprint:
    return pb.ModelFingerprint(**dataclasses.asdict(fingerprint))


def fingerprint_from_proto(message: pb.ModelFingerprint) -> Fingerprint:
    return Fingerprint(
        message.parameter_count,
        message.parameter_bytes,
        message.tensor_count,
        message.largest_tensor_bytes,
        message.median_tensor_bytes,
        message.digest,
    )


def engine_from_proto(engine: str) -> str:
    """A registration's engine; empty (a client before engines) is the scheduler. ValueError names
    an unknown one."""
    engine = engine or "scheduler"
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
    return engine


def registration_from_proto(request: pb.RegisterRequest) -> Registration:
    """Raises ValueError on a bad configuration, an unknown engine or a configuration of another
    engine's knobs; the other checks are the daemon's."""
    engine = engine_from_proto(request.engine)
    config = config_from_proto(request.config)
    config.for_engine(engine)
    return Registration(
        job=request.job,
        rank=request.rank,
        world_size=request.world_size,
        backend=request.backend or "unknown",
        instance_id=request.instance_id,
        hostname=request.hostname,
        pid=request.pid,
        fingerprint=fingerprint_from_proto(request.model),
        config=config,
        tuning_disabled=request.tuning_disabled,
        engine=engine,
        memory=memory_from_proto(request),
        collective_latency_s=collective_latency_from_proto(request.collective_latency_s),
        shard_layout=shard_layout_from_proto(request, engine),
    )


MAX_COLLECTIVE_LATENCY_S = 60.0  # one small all-reduce; beyond it, not a measurement


def collective_latency_from_proto(value: float) -> float:
    """ValueError for a latency that is not a number of seconds in [0, MAX_COLLECTIVE_LATENCY_S]."""
    if not math.isfinite(value) or not 0.0 <= value <= MAX_COLLECTIVE_LATENCY_S:
        raise ValueError(
            f"collective_latency_s must be seconds in [0, {MAX_COLLECTIVE_LATENCY_S:g}], got {value!r}"
        )
    return float(value)


def memory_from_proto(request: pb.RegisterRequest) -> MemoryLimits | None:
    """ValueError for a bad budget, too many configurations or one of the scheduler's knobs."""
    if not request.HasField("memory_budget_bytes"):
        if request.over_budget:
            raise ValueError("over_budget is given without a memory_budget_bytes")
        return None
    if len(request.over_budget) > MAX_OVER_BUDGET:  # before converting them
        raise ValueError(f"over_budget names more than {MAX_OVER_BUDGET} configurations")
    return MemoryLimits(
        request.memory_budget_bytes,
        frozenset(config_from_proto(c) for c in request.over_budget),
    )


def shard_layout_from_proto(request: pb.RegisterRequest, engine: str) -> ShardLayout | None:
    """ValueError for a layout of no groups, too many, a byte count out of range, or one that a
    job of another engine than fsdp2 sends."""
    if not request.HasField("shard_layout"):
        return None
    if engine != "fsdp2":
        raise ValueError(f"a shard layout describes an fsdp2 job; this job runs {engine}")
    layout = request.shard_layout
    if len(layout.group_bytes) > MAX_SHARD_GROUPS:  # before converting them
        raise ValueError(f"a shard layout names more than {MAX_SHARD_GROUPS} groups")
    return ShardLayout(tuple(layout.group_bytes), layout.root_bytes, layout.async_gathers)


def shard_layout_to_proto(layout: ShardLayout | None) -> dict:
    """RegisterRequest's layout field, as keyword arguments (none without a layout)."""
    if layout is None:
        return {}
    return {
        "shard_layout": pb.ShardLayout(
            group_bytes=list(layout.group_bytes),
            root_bytes=layout.root_bytes,
            async_gathers=layout.async_gathers,
        )
    }


def memory_to_proto(memory: MemoryLimits | None) -> dict:
    """RegisterRequest's memory fields, as keyword arguments (none without a budget)."""
    if memory is None:
        return {}
    return {
        "memory_budget_bytes": memory.budget_bytes,
        "over_budget": [config_to_proto(c) for c in sorted(memory.over_budget, key=str)],
    }


_DECISION_OPTIONAL = ("predicted_step_time_s", "measured_step_time_s", "applied_at_step")


def decision_to_proto(record: DecisionRecord) -> pb.Decision:
    message = pb.Decision(
        decision_id=record.decision_id,
        job=record.job,
        config=config_to_proto(record.config),
        apply_at_step=record.apply_at_step,
        reason=record.reason,
        created_at_s=record.created_at_s,
        state=record.state,
        source=record.source,
    )
    for name in _DECISION_OPTIONAL:
        if getattr(record, name) is not None:
            setattr(message, name, getattr(record, name))
    return message


def decision_from_proto(message: pb.Decision) -> DecisionRecord:
    """An empty source reads as "operator" (what a daemon before sources meant)."""
    optional = {
        name: getattr(message, name) if message.HasField(name) else None
        for name in _DECISION_OPTIONAL
    }
    return DecisionRecord(
        decision_id=message.decision_id,
        job=message.job,
        config=config_from_proto(message.config),
        apply_at_step=message.apply_at_step,
        reason=message.reason,
        created_at_s=message.created_at_s,
        state=message.state,
        source=message.source or "operator",
        **optional,
    )


def config_update_to_proto(record: DecisionRecord) -> pb.ConfigUpdate:
    """A decision as the Control service pushes it to a job."""
    return pb.ConfigUpdate(
        job=record.job,
        decision_id=record.decision_id,
        config=config_to_proto(record.config),
        apply_at_step=record.apply_at_step,
        reason=record.reason,
    )


def tuner_status_to_proto(
    record: TunerStatusRecord, known: bool = True, with_config: bool = True
) -> pb.TunerStatus:
    """known=False: the tuner has not looked at the job yet; with_config=False leaves the message's
    config unset (a status that holds no configuration)."""
    message = pb.TunerStatus(
        mode=record.mode,
        state=record.state,
        detail=record.detail,
        baseline_step_time_s=record.baseline_step_time_s,
        measured_step_time_s=record.measured_step_time_s,
        predicted_step_time_s=record.predicted_step_time_s,
        paused=record.paused,
        trials_done=record.trials_done,
        trials_planned=record.trials_planned,
        updated_at_s=record.updated_at_s,
        known=known,
    )
    if with_config:
        message.config.CopyFrom(config_to_proto(record.config))
    return message


def tuner_status_from_proto(message: pb.TunerStatus) -> TunerStatusRecord:
    return TunerStatusRecord(
        mode=message.mode,
        state=message.state,
        detail=message.detail,
        config=config_from_proto(message.config),
        baseline_step_time_s=message.baseline_step_time_s,
        measured_step_time_s=message.measured_step_time_s,
        predicted_step_time_s=message.predicted_step_time_s,
        trials_done=message.trials_done,
        trials_planned=message.trials_planned,
        paused=message.paused,
        updated_at_s=message.updated_at_s,
    )


def job_status_to_proto(job: JobRecord, tuner: pb.TunerStatus) -> pb.JobStatus:
    """`tuner`: what the daemon says its tuner does for the job (it may differ from job.tuner)."""
    message = pb.JobStatus(
        job=job.job,
        state=job.state,
        world_size=job.world_size,
        steps=job.steps,
        config=config_to_proto(job.config),
        ranks=job.ranks,
        backend=job.backend,
        recent_step_time_s=job.recent_step_time_s,
        recent_steps_per_s=1.0 / job.recent_step_time_s if job.recent_step_time_s else 0.0,
        last_seen_s=job.last_seen_s,
        dropped_total=job.dropped_total,
        has_last_decision=job.last_decision is not None,
        engine=job.engine,
    )
    message.tuner.CopyFrom(tuner)
    if job.last_decision is not None:
        message.last_decision.CopyFrom(decision_to_proto(job.last_decision))
    return message


def job_status_from_proto(message: pb.JobStatus) -> JobRecord:
    """tuning_disabled is not on the wire (the tuner status says it); it reads as False."""
    return JobRecord(
        job=message.job,
        state=message.state,
        world_size=message.world_size,
        backend=message.backend,
        steps=message.steps,
        config=config_from_proto(message.config),
        ranks=tuple(message.ranks),
        recent_step_time_s=message.recent_step_time_s,
        last_seen_s=message.last_seen_s,
        dropped_total=message.dropped_total,
        last_decision=decision_from_proto(message.last_decision)
        if message.has_last_decision
        else None,
        tuner=tuner_status_from_proto(message.tuner),
        engine=message.engine or "scheduler",
    )


def history_step_to_proto(step: HistoryStep) -> pb.StepRecord:
    return pb.StepRecord(
        config=config_to_proto(step.config),
        **{name: getattr(step, name) for name in _HISTORY_FIELDS},
    )


def history_step_from_proto(message: pb.StepRecord) -> HistoryStep:
    return HistoryStep(
        config=config_from_proto(message.config),
        **{name: getattr(message, name) for name in _HISTORY_FIELDS},
    )


def history_to_proto(
    job: str, steps: Iterable[HistoryStep], decisions: Iterable[DecisionRecord]
) -> pb.HistoryResponse:
    response = pb.HistoryResponse(job=job)
    response.steps.extend(history_step_to_proto(step) for step in steps)
    response.decisions.extend(decision_to_proto(d) for d in decisions)
    return response


def best_to_proto(best: BestRecord) -> pb.BestResponse:
    response = pb.BestResponse(
        job=best.job,
        found=best.found,
        config=config_to_proto(best.config),
        median_step_time_s=best.median_step_time_s,
        samples=best.samples,
        baseline_step_time_s=best.baseline_step_time_s,
        evidence=best.evidence,
        context=best.context,
        reference=config_to_proto(best.reference),
        reference_step_time_s=best.reference_step_time_s,
        contexts=best.contexts,
    )
    for candidate in best.candidates:
        response.candidates.add(
            config=config_to_proto(candidate.config),
            samples=candidate.samples,
            median_step_time_s=candidate.median_step_time_s,
            speedup=candidate.speedup,
        )
    return response


def best_from_proto(message: pb.BestResponse) -> BestRecord:
    return BestRecord(
        job=message.job,
        found=message.found,
        config=config_from_proto(message.config),
        median_step_time_s=message.median_step_time_s,
        samples=message.samples,
        baseline_step_time_s=message.baseline_step_time_s,
        evidence=message.evidence,
        candidates=tuple(
            CandidateRecord(
                config=config_from_proto(c.config),
                median_step_time_s=c.median_step_time_s,
                samples=c.samples,
                speedup=c.speedup,
            )
            for c in message.candidates
        ),
        context=message.context,
        reference=config_from_proto(message.reference),
        reference_step_time_s=message.reference_step_time_s,
        contexts=message.contexts,
    )
