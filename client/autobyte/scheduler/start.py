"""The starting configuration derived from the job: what `partition_bytes="auto"` (the default)
becomes when the scheduler is built.

A partition costs the backend a fixed latency per collective (`latency_s`: a ring all-reduce's
2(N-1) hops, gloo's or NCCL's launch) on top of its bytes (`seconds_per_byte`, the wire's rate
with the ring's 2(N-1)/N factor). With B bytes of gradients cut into partitions of s bytes, the
latencies cost (B / s) x latency_s a step. At the end of the backward pass the gradients the next
forward needs first queue behind the credit window, k = CREDIT_PARTITIONS partitions in flight:
k x s x seconds_per_byte of exposed communication. The sum is smallest at

    s = sqrt(B x latency_s / (k x seconds_per_byte))

rounded to a power of two (the tuner's grid), at least MIN_AUTO_PARTITION_BYTES, at most B (one
partition, DDP's one bucket), and the credit window k partitions. Both costs are measured on the
job's own process group when the scheduler is built (`measure_cost`: a few all-reduces of one
element and of a probe of up to PROBE_BYTES, some milliseconds on a fast link), and every rank takes
the slowest rank's figures, so every rank derives the same configuration.

The derivation is a start, not a search: the tuner (autobyted) starts from it and moves on from
there as the link and the load change. A user's explicit sizes always win.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from autobyte.types import MAX_PARTITION_BYTES, Config, format_bytes

AUTO = "auto"  # the default of partition_bytes / credit_bytes: derived from the job
PROBE_BYTES = 4 << 20  # above the burst of a shaped link (the testbed's tbf: 512 KiB)
TINY_REPEATS = 7
PROBE_REPEATS = 3
CREDIT_PARTITIONS = 4  # the credit window, in partitions (the constant default's 16 MiB / 4 MiB)
MIN_AUTO_PARTITION_BYTES = 64 << 10
FALLBACK = Config(4 << 20, 16 << 20)  # one rank: nothing to send, the historical default


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """One all-reduce on the job's group: latency_s + bytes x seconds_per_byte."""

    latency_s: float
    seconds_per_byte: float


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def check_sizes(partition_bytes: Any, credit_bytes: Any) -> None:
    """ValueError for a string other than "auto" (the numbers are Config's to check)."""
    for name, value in (("partition_bytes", partition_bytes), ("credit_bytes", credit_bytes)):
        if isinstance(value, str) and value != AUTO:
            raise ValueError(f'{name} must be a number of bytes, None or "auto", got {value!r}')


@dataclasses.dataclass(frozen=True)
class Requested:
    """The sizes a wrapper (Accelerate, Lightning) was given, checked when given: numbers, None or
    "auto"; the ScheduledOptimizer it builds resolves them."""

    partition_bytes: int | str | None = AUTO
    credit_bytes: int | str | None = AUTO
    tail_bytes: int | None = None

    def __post_init__(self) -> None:
        check_sizes(self.partition_bytes, self.credit_bytes)
        Config(  # ValueError naming a bad number
            None if is_auto(self.partition_bytes) else self.partition_bytes,
            None if is_auto(self.credit_bytes) else self.credit_bytes,
            self.tail_bytes,
        )

    def describe(self) -> str:
        if not (is_auto(self.partition_bytes) or is_auto(self.credit_bytes)):
            return Config(self.partition_bytes, self.credit_bytes, self.tail_bytes).describe()
        words = [
            f"{name}={value if is_auto(value) else format_bytes(value, 'none')}"
            for name, value in (("partition", self.partition_bytes), ("credit", self.credit_bytes))
        ]
        if self.tail_bytes is not None:
            words.append(f"tail={format_bytes(self.tail_bytes)}")
        return " ".join(words)


def _timed(fn: Any, device: torch.device) -> float:
    start = time.perf_counter()
    fn()
    if device.type == "cuda":  # untested here (no GPU): the collective runs on a stream
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _slowest(values: list[float], group: Any, device: torch.device) -> list[float]:
    """Every rank's `values`, element-wise the largest of the group's (collective)."""
    agreed = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return agreed.tolist()


def measure_cost(
    group: Any, device: torch.device, dtype: torch.dtype, grad_bytes: int
) -> CollectiveCost:
    """The group's all-reduce cost, measured (collective: every rank of `group` calls it at the same
    point). The slowest rank's figures on every rank."""
    element = torch.empty((), dtype=dtype).element_size()
    tiny = torch.zeros(1, dtype=dtype, device=device)
    probe_bytes = max(element, min(PROBE_BYTES, grad_bytes))
    probe = torch.zeros(probe_bytes // element, dtype=dtype, device=device)

    def reduce(t: torch.Tensor) -> Any:
        return lambda: dist.all_reduce(t, group=group)

    _timed(reduce(tiny), device)  # untimed: the ranks arrive at different times
    _timed(reduce(probe), device)  # untimed: buffers and connections set up
    latency = statistics.median(_timed(reduce(tiny), device) for _ in range(TINY_REPEATS))
    probe_s = statistics.median(_timed(reduce(probe), device) for _ in range(PROBE_REPEATS))
    latency, probe_s = _slowest([latency, probe_s], group, device)
    per_byte = max(probe_s - latency, 0.0) / (probe.numel() * element)
    return CollectiveCost(latency, per_byte)


SMALL_ELEMENTS = 1024  # the per-collective cost's probe: 4 KB of fp32


def measure_latency(group: Any, device: torch.device, dtype: torch.dtype) -> float:
    """The group's per-collective cost as the daemon's predictor reads it (collective): one
    all-reduce of SMALL_ELEMENTS elements at a time, the slowest rank's median. Not
    `measure_cost`'s single element: a ring splits a buffer into one chunk a rank, and one
    element leaves most of its 2(N-1) hops empty (at 8 gloo ranks on a 2-core host 2 ms, where
    4 KB, like any partition, takes 22 ms); a few KB is still all latency on any link."""
    small = torch.zeros(SMALL_ELEMENTS, dtype=dtype, device=device)

    def reduce() -> None:
        dist.all_reduce(small, group=group)

    _timed(reduce, device)  # untimed: the ranks arrive at different times
    latency = statistics.median(_timed(reduce, device) for _ in range(TINY_REPEATS))
    return _slowest([latency], group, device)[0]


def derive(grad_bytes: int, cost: CollectiveCost) -> Config:
    """The starting configuration for `grad_bytes` of gradients at `cost` (module docstring)."""
    if grad_bytes <= 0:
        return FALLBACK
    if cost.seconds_per_byte <= 0.0:  # no measurable transfer time: latency is all there is
        ideal = float(grad_bytes)
    else:
        ideal = math.sqrt(grad_bytes * cost.latency_s / (CREDIT_PARTITIONS * cost.seconds_per_byte))
    ideal = min(max(ideal, MIN_AUTO_PARTITION_BYTES), grad_bytes, MAX_PARTITION_BYTES / 4)
    partition = 1 << max(0, round(math.log2(max(ideal, 1.0))))
    partition = max(partition, MIN_AUTO_PARTITION_BYTES)
    return Config(partition, partition * CREDIT_PARTITIONS)


def resolve(
    partition_bytes: Any,
    credit_bytes: Any,
    *,
    world: int,
    group: Any,
    device: torch.device,
    dtype: torch.dtype,
    grad_bytes: int,
) -> tuple[Config, CollectiveCost | None]:
    """The configuration to start from: the user's sizes where given, the derived ones where
    "auto" (measuring the group only then), and the measured cost (None if nothing was measured)."""
    check_sizes(partition_bytes, credit_bytes)
    cost = None
    partition = partition_bytes
    if is_auto(partition_bytes):
        derived = FALLBACK
        if world > 1:
            cost = measure_cost(group, device, dtype, grad_bytes)
            derived = derive(grad_bytes, cost)
        partition = derived.partition_bytes
    if is_auto(credit_bytes):
        credit = None if partition is None else partition * CREDIT_PARTITIONS
    else:
        credit = credit_bytes
    return Config(partition, credit), cost
