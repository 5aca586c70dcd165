"""The predictor's features: a job's context measured under a reference configuration, plus that
reference and one candidate configuration (the list and the reasons are in autobyted/tuner/__init__).

The target is relative: log(step time of the candidate / step time of the reference), both in the
same context. Everything here is pure and cheap (no xgboost, no storage).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Sequence

import numpy as np
from autobyte.types import Config, StepMetrics

from autobyted.storage.records import Fingerprint, JobInfo

NAN = float("nan")


@dataclasses.dataclass(frozen=True)
class JobShape:
    """What the registration says about a job (config-independent, fixed for the job)."""

    world_size: int
    backend: str
    parameter_bytes: int
    tensor_count: int
    largest_tensor_bytes: int
    median_tensor_bytes: int
    # One small all-reduce on the job's group, measured by the client when its scheduler
    # was built (0.0: unknown). A measurement of the cluster, not of the model: two runs of one
    # model at one world size are the same shape whatever each measured (compare=False).
    collective_latency_s: float = dataclasses.field(default=0.0, compare=False)

    @classmethod
    def from_info(cls, info: JobInfo) -> JobShape:
        return cls.from_fingerprint(
            info.world_size, info.backend, info.fingerprint, info.collective_latency_s
        )

    @classmethod
    def from_fingerprint(
        cls, world_size: int, backend: str, fp: Fingerprint, collective_latency_s: float = 0.0
    ) -> JobShape:
        return cls(
            world_size=max(1, world_size),
            backend=backend or "unknown",
            parameter_bytes=max(0, fp.parameter_bytes),
            tensor_count=max(0, fp.tensor_count),
            largest_tensor_bytes=max(0, fp.largest_tensor_bytes),
            median_tensor_bytes=max(0, fp.median_tensor_bytes),
            collective_latency_s=max(0.0, collective_latency_s),
        )

    def same_model(self, other: JobShape) -> bool:
        """The same model on the same backend, at any world size (a job restarted at another rank
        count: tuner.evidence's `carried`)."""
        return dataclasses.replace(other, world_size=self.world_size) == self


@dataclasses.dataclass(frozen=True)
class Context:
    """Medians of a window of one configuration's steps (rank 0), plus the job's shape."""

    shape: JobShape
    step_time_s: float
    forward_s: float
    backward_s: float
    exposed_comm_s: float
    queueing_delay_s: float
    bytes_reduced: float
    partitions: float
    bandwidth_bytes_per_s: float
    host_load: float  # 0.0: unknown

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Context:
        data = json.loads(text)
        data["shape"] = JobShape(**data["shape"])
        return cls(**data)


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def summarize(samples: Sequence[StepMetrics], shape: JobShape) -> Context:
    """The context of a window: per-field medians (robust to the odd slow step). Host load is the
    median of the samples that know it (0.0 when none do)."""
    if not samples:
        raise ValueError("a context needs at least one sample")
    loads = [s.host_load for s in samples if s.host_load > 0]
    return Context(
        shape=shape,
        step_time_s=_median([s.step_time_s for s in samples]),
        forward_s=_median([s.forward_s for s in samples]),
        backward_s=_median([s.backward_s for s in samples]),
        exposed_comm_s=_median([s.exposed_comm_s for s in samples]),
        queueing_delay_s=_median([s.queueing_delay_s for s in samples]),
        bytes_reduced=_median([float(s.bytes_reduced) for s in samples]),
        partitions=_median([float(s.partitions) for s in samples]),
        bandwidth_bytes_per_s=_median([s.bandwidth_bytes_per_s for s in samples]),
        host_load=_median(loads) if loads else 0.0,
    )


def _log(value: float) -> float:
    return math.log(value) if value > 0 and math.isfinite(value) else NAN


def _log2(value: float) -> float:
    return math.log2(value) if value > 0 and math.isfinite(value) else NAN


def messages_per_step(config: Config, shape: JobShape, gradient_bytes: float) -> float:
    """All-reduces per step under `config`, as the scheduler cuts them: one per tensor without
    partitioning, otherwise slices of the whole gradient buffer."""
    if config.partition_bytes is None:
        return float(max(1, shape.tensor_count))
    return float(max(1, math.ceil(max(gradient_bytes, 1.0) / config.partition_bytes)))


def _config_features(config: Config, shape: JobShape, gradient_bytes: float) -> list[float]:
    p, c, t = config.partition_bytes, config.credit_bytes, config.tail_bytes
    messages = messages_per_step(config, shape, gradient_bytes)
    return [
        1.0 if t is None else 0.0,
        _log2(min(t, gradient_bytes) / gradient_bytes)
        if t is not None and gradient_bytes > 0
        else NAN,
        _log2(t / c) if t is not None and c is not None else NAN,
        1.0 if p is None else 0.0,
        _log2(p) if p is not None else NAN,
        _log2(p / gradient_bytes) if p is not None and gradient_bytes > 0 else NAN,
        1.0 if c is None else 0.0,
        _log2(c) if c is not None else NAN,
        _log2(c / gradient_bytes) if c is not None and gradient_bytes > 0 else NAN,
        _log2(c / (p or max(shape.median_tensor_bytes, 1))) if c is not None else NAN,
        _log(messages),
    ]


CONFIG_FEATURES = (
    "tail_none",
    "log2_tail_share",
    "log2_tail_in_credits",
    "partition_none",
    "log2_partition",
    "log2_partition_share",
    "credit_unlimited",
    "log2_credit",
    "log2_credit_share",
    "log2_credit_in_partitions",
    "log_messages",
)
_LOG_MESSAGES = CONFIG_FEATURES.index("log_messages")
CONTEXT_FEATURES = (
    "log_step_s",
    "log_compute_s",
    "backward_share",
    "compute_share",
    "exposed_share",
    "queueing_share",
    "log_gradient_bytes",
    "log2_world_size",
    "ring_factor",
    "backend_nccl",
    "backend_gloo",
    "log_tensor_count",
    "largest_tensor_share",
    "log_median_tensor_bytes",
    "log_bandwidth",
    "log_wire_s",
    "log_wire_to_compute",
    "host_load",
)
FEATURE_NAMES = (
    CONTEXT_FEATURES
    + tuple(f"ref_{n}" for n in CONFIG_FEATURES)
    + tuple(f"cand_{n}" for n in CONFIG_FEATURES)
    + ("delta_log_messages", "delta_log2_partition", "delta_log2_credit")
    + ("ref_latency_share", "cand_latency_share", "delta_latency_share")
)


def context_features(ctx: Context) -> list[float]:
    shape = ctx.shape
    step = ctx.step_time_s
    compute = ctx.compute_s
    gradient = ctx.bytes_reduced or float(shape.parameter_bytes)
    ring = 2 * (shape.world_size - 1) / shape.world_size
    wire = ring * gradient / ctx.bandwidth_bytes_per_s if ctx.bandwidth_bytes_per_s > 0 else NAN
    return [
        _log(step),
        _log(compute),
        ctx.backward_s / compute if compute > 0 else NAN,
        compute / step if step > 0 else NAN,
        ctx.exposed_comm_s / step if step > 0 else NAN,
        ctx.queueing_delay_s / step if step > 0 else NAN,
        _log(gradient),
        math.log2(shape.world_size),
        ring,
        1.0 if shape.backend == "nccl" else 0.0,
        1.0 if shape.backend == "gloo" else 0.0,
        _log(shape.tensor_count),
        shape.largest_tensor_bytes / shape.parameter_bytes if shape.parameter_bytes > 0 else NAN,
        _log(shape.median_tensor_bytes),
        _log(ctx.bandwidth_bytes_per_s),
        _log(wire),
        _log(wire) - _log(compute) if compute > 0 else NAN,
        ctx.host_load if ctx.host_load > 0 else NAN,
    ]


def feature_matrix(ctx: Context, reference: Config, candidates: Sequence[Config]) -> np.ndarray:
    """One row per candidate: (context, reference configuration, candidate configuration)."""
    gradient = ctx.bytes_reduced or float(ctx.shape.parameter_bytes)
    base = context_features(ctx)
    ref = _config_features(reference, ctx.shape, gradient)
    # For the differences: no partitioning sends tensors whole (their mean size), unlimited credit
    # lets the whole gradient be in flight.
    mean_tensor = gradient / max(1, ctx.shape.tensor_count)

    def effective(config: Config) -> tuple[float, float]:
        return (
            _log2(config.partition_bytes or mean_tensor),
            _log2(min(config.credit_bytes or gradient, gradient)),
        )

    ref_p, ref_c = effective(reference)
    # The per-collective cost: the share of the reference's step that each configuration's
    # collectives cost in fixed latency alone (messages x the measured single-element all-reduce),
    # and the difference, the step time a switch adds or saves in latency before any overlap.
    latency = ctx.shape.collective_latency_s
    per_message = latency / ctx.step_time_s if latency > 0 and ctx.step_time_s > 0 else NAN
    ref_share = math.exp(ref[_LOG_MESSAGES]) * per_message
    rows = []
    for candidate in candidates:
        cand = _config_features(candidate, ctx.shape, gradient)
        cand_p, cand_c = effective(candidate)
        cand_share = math.exp(cand[_LOG_MESSAGES]) * per_message
        rows.append(
            base
            + ref
            + cand
            + [cand[_LOG_MESSAGES] - ref[_LOG_MESSAGES], cand_p - ref_p, cand_c - ref_c]
            + [ref_share, cand_share, cand_share - ref_share]
        )
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(FEATURE_NAMES))
