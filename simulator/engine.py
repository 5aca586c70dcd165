"""Discrete-event model of data-parallel training steps under the scheduler or DDP.

One step on every worker (all workers are identical, so one is simulated):

- forward: layer i starts when layer i-1 finished and, under the scheduler, when layer i's
  parameters from the previous step are reduced and updated (cross-iteration overlap);
- backward: layers in reverse order; a layer's gradients are ready when its backward ends;
- scheduler: as the real scheduler does, the gradients lie in one flat buffer in reverse forward
  order, cut into slices of `partition_bytes` (a slice fuses small tensors, a big tensor spans
  several slices; with no partitioning, one message per tensor); a dispatcher thread issues the
  highest-priority ready partition (priority = forward order) while the bytes in flight are below
  `credit_bytes` -- or, in the tail window (`tail_bytes`: at most that many gradient bytes of the
  step not yet ready), only while nothing is in flight; issuing costs `launch_s` of that thread;
  the link runs the issued all-reduces first-in-first-out (as gloo does), each costing a ring
  all-reduce; an embedding table the scheduler reduces row-sparse (`sparse_wire`) is a partition of
  its own and costs two collectives: its mask, then the rows some worker touched;
- DDP: tensors in reverse registration order fill 25 MiB buckets (the first 1 MiB, as torch does);
  a bucket is reduced once all its gradients are ready, buckets in order; the optimizer step and
  the next forward wait for every bucket.

A ring all-reduce of B bytes among N workers costs
    collective_overhead_s + 2(N-1) * latency_s + 2(N-1)/N * B / bandwidth
with the bandwidth following a piecewise-constant trace (the transfer is integrated across changes).

Because every layer's forward waits for its own reduced parameters, all of a step's communication
ends before the next step's backward begins: the communication of one step depends only on the
backward start time, the bandwidth trace and the configuration. With a constant bandwidth over that
window the schedule is the same every step, so it is computed once and cached; that is what makes
1,000 ResNet-50 steps take milliseconds instead of seconds.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
from autobyte.types import Config, format_bytes, parse_bytes

from simulator.profiles import LayerProfile, ModelProfile, RowSparseTable
from simulator.trace import PiecewiseConstant

MIB = 1 << 20
MAX_COMM_CPU_SHARE = 0.95  # communication never takes more than this share of a rank's CPU
# The scheduler's row-sparse reduction of embedding tables, as client/autobyte/scheduler/
# sparse_rows.py does it (tests/test_sim.py holds these to the client's constants).
SPARSE_MIN_BYTES = 1 << 20
SPARSE_MIN_ROW_BYTES = 64
# Its zero test reads the table's bits once a step before the mask goes out (the dispatch thread,
# before the collective): 1.2 ms for the testbed transformer's 8 MiB table.
SPARSE_SCAN_S_PER_BYTE = 1.2e-3 / (8 * MIB)


def sparse_wire(table: RowSparseTable | None, nbytes: int, workers: int) -> int | None:
    """Bytes one step puts on the wire for a tensor of `nbytes` the scheduler reduces row-sparse, in
    steady state: the mask (one byte per row) and the rows some worker touched. None when the tensor
    goes whole: no table, a table the client does not take (under SPARSE_MIN_BYTES, rows narrower
    than SPARSE_MIN_ROW_BYTES), one worker, or a union of more than half the rows (the client then
    sends the whole slice, and after four such steps no mask either)."""
    if (
        table is None
        or workers <= 1
        or nbytes < SPARSE_MIN_BYTES
        or nbytes // table.rows < SPARSE_MIN_ROW_BYTES
    ):
        return None
    union_rows = round(table.union(workers) * table.rows)
    if 2 * union_rows > table.rows:
        return None
    return union_rows * (nbytes // table.rows) + table.rows


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    """PyTorch DDP's gradient buckets: the no-scheduling baseline."""

    bucket_bytes: int = 25 * MIB
    first_bucket_bytes: int = 1 * MIB

    def describe(self) -> str:
        return "ddp"


RunConfig = Config | DDPConfig
DDP = DDPConfig()


def parse_config(label: str) -> RunConfig:
    """ "ddp" or "sched:P,C[,T]" (the labels of measured runs and testbed events) -> a RunConfig."""
    text = label.strip().lower()
    if text == "ddp":
        return DDP
    if text.startswith("sched:"):
        parts = text[len("sched:") :].split(",")
        if len(parts) in (2, 3):
            return Config(*(parse_bytes(part) for part in parts))
    raise ValueError(f"bad configuration {label!r}: use ddp or sched:P,C[,T]")


def describe_config(config: RunConfig) -> str:
    if isinstance(config, DDPConfig):
        return "ddp"
    tail = "" if config.tail_bytes is None else f",{format_bytes(config.tail_bytes)}"
    return f"{format_bytes(config.partition_bytes, 'none')},{format_bytes(config.credit_bytes, 'inf')}{tail}"


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """Costs of one all-reduce besides the bytes on the wire (defaults: gloo-like, calibrated in benchmarks/calibration/)."""

    latency_s: float = 25e-6  # per ring hop message; a ring all-reduce pays it 2(N-1) times
    collective_overhead_s: float = 200e-6  # fixed backend cost of one collective, occupies the link
    launch_s: float = 100e-6  # scheduler thread time to issue one partition (Python + launch)
    ddp_launch_s: float = 20e-6  # DDP's C++ reducer issuing one bucket
    # Compute slowed while an all-reduce is on the link, because the backend's threads take CPU
    # from the training thread (0 / 1.0 on a GPU with NCCL). Forward and backward progress at
    # 1/slowdown while the link is busy, with
    #     slowdown = comm_compute_slowdown / (1 - min(comm_cpu_s_per_byte * bandwidth, 0.95))
    # comm_cpu_s_per_byte: CPU seconds per all-reduced byte (a rank's core is shared between its
    # compute and the bytes it moves; measured as the inverse of the unshaped all-reduce goodput
    # when that is CPU-bound, ~1 ns/B for gloo over veth on this 2-core machine: at 10gbit compute
    # all but stops while gradients move, at 1gbit it runs ~1.15x slower).
    comm_compute_slowdown: float = 1.0
    comm_cpu_s_per_byte: float = 0.0
    # Cost of one collective beyond collective_overhead_s and the wire time, by message size:
    # ((bytes, seconds), ...) interpolated in log2(bytes), flat beyond the first and last point.
    # `message_extra_s` always applies; `flow_message_extra_s` once per competing TCP flow on the
    # link (measured: a collective's TCP transfer ramps up behind the competitor's queue, so a
    # mid-size message costs several inflated round trips; benchmarks/calibrate_map.py fits it).
    message_extra_s: tuple[tuple[float, float], ...] = ()
    flow_message_extra_s: tuple[tuple[float, float], ...] = ()
    # Share of a link a job keeps against `flows` backlogged competing TCP flows:
    # 1 / (1 + flow_weight * flows) (TCP's fair share for flow_weight = 1).
    flow_weight: float = 1.0
    # When the slowest worker's CPU share comes from a CFS quota (a container's CPU limit: the
    # cgroup runs its share of every period, then all its threads stop until the next one), its
    # communication threads stall too: every event of a collective that needs the throttled
    # workers (issuing it, each of the ring's 2(N-1) steps) waits until all of them run again. A
    # busy worker is throttled for the last (1 - share) * period of a period, so one event waits
    # 0 with probability share, else uniformly up to that; with k = `quota_workers` independently
    # throttled workers the mean of the longest wait is
    #     D * (1 - (1 - share^(k+1)) / ((k+1) * (1 - share))),  D = (1 - share) * period
    # ((1 - share)^2 * period / 2 for k = 1). 0 = the share is time-shared with other processes
    # instead (CFS wake-up preemption: no such stalls).
    quota_period_s: float = 0.0
    quota_workers: int = 1
    # A collective's fixed cost and its wire time overlap: it holds the link for the larger of the
    # two, not their sum. So on the emulated testbed at N ranks, where the fixed cost is the ring's
    # 2(N-1) hops waiting for N processes to be scheduled on the host's cores while the shaped link
    # drains the bytes of the collectives in flight beside it (benchmarks/sim_vs_emulated.py).
    fixed_overlaps_wire: bool = False
    # A lone collective's cost as a rank measures it (one small all-reduce, nothing else
    # in flight: autobyte.scheduler.start.measure_latency) where it differs from the cost of one
    # among several in flight above (gloo at N ranks on this host: simulator/links.py); None: the
    # same costs.
    lone_collective_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("message_extra_s", "flow_message_extra_s"):
            table = tuple(tuple(float(v) for v in point) for point in getattr(self, name))
            if any(len(point) != 2 or point[0] <= 0 or point[1] < 0 for point in table):
                raise ValueError(f"{name} must list (bytes > 0, seconds >= 0) points")
            object.__setattr__(self, name, tuple(sorted(table)))  # type: ignore[arg-type]
        if self.flow_weight < 0:
            raise ValueError(f"flow_weight must be >= 0, got {self.flow_weight}")

    def compute_slowdown(self, bandwidth_bytes_per_s: float, cpu_share: float = 1.0) -> float:
        """Compute's slowdown while an all-reduce is on the link, on a worker that has `cpu_share`
        cores: the communication's CPU load counts against that share."""
        load = min(self.comm_cpu_s_per_byte * bandwidth_bytes_per_s / cpu_share, MAX_COMM_CPU_SHARE)
        return self.comm_compute_slowdown / (1.0 - load)

    def flow_share(self, flows: float) -> float:
        """Share of the link left to the job next to `flows` competing TCP flows."""
        return 1.0 / (1.0 + self.flow_weight * max(0.0, flows))

    def message_s(
        self, nbytes: float, workers: int, flows: float = 0.0, cpu_share: float = 1.0
    ) -> float:
        """Per-collective time of a message of `nbytes` besides its wire time."""
        extra = _interpolate_log2(self.message_extra_s, nbytes)
        if flows > 0:
            extra += flows * _interpolate_log2(self.flow_message_extra_s, nbytes)
        return self.fixed_s(workers) + extra + self.quota_stall_s(workers, cpu_share)

    def quota_stall_s(self, workers: int, cpu_share: float) -> float:
        """Mean wait of one collective for throttled workers (see quota_period_s)."""
        if self.quota_period_s <= 0 or cpu_share >= 1.0 or workers <= 1:
            return 0.0
        events = 2 * (workers - 1) + 1
        q, k = 1.0 - cpu_share, max(1, self.quota_workers)
        longest = q * self.quota_period_s * (1.0 - (1.0 - cpu_share ** (k + 1)) / ((k + 1) * q))
        return events * longest

    def tiny_collective_s(self, workers: int, nbytes: int = 4096) -> float:
        """What a rank measures as one small all-reduce (the client's
        autobyte.scheduler.start.measure_latency, 4 KB): issuing it and its per-collective cost."""
        if workers <= 1:
            return 0.0
        if self.lone_collective_s is not None:
            return self.lone_collective_s
        return self.launch_s + self.message_s(nbytes, workers)

    def fixed_s(self, workers: int) -> float:
        """Per-collective time that does not depend on size."""
        if workers <= 1:
            return 0.0
        return self.collective_overhead_s + 2 * (workers - 1) * self.latency_s


def _interpolate_log2(table: tuple[tuple[float, float], ...], nbytes: float) -> float:
    if not table:
        return 0.0
    if nbytes <= table[0][0]:
        return table[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(table):
        if nbytes <= x1:
            w = (math.log2(nbytes) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
            return y0 + w * (y1 - y0)
    return table[-1][1]


def ring_allreduce_s(
    nbytes: float, workers: int, bandwidth_bytes_per_s: float, latency_s: float
) -> float:
    """Ring all-reduce time: 2(N-1)/N * bytes / bandwidth + 2(N-1) * latency."""
    if workers <= 1:
        return 0.0
    return (
        2 * (workers - 1) / workers * nbytes / bandwidth_bytes_per_s + 2 * (workers - 1) * latency_s
    )


def lower_bound_step_s(
    profile: ModelProfile,
    workers: int,
    bandwidth_bytes_per_s: float,
    compute_factor: float = 1.0,
    row_sparse: bool = True,
) -> float:
    """Perfect overlap: max(compute, pure wire time of all gradients, row-sparse tables at their
    wire bytes unless `row_sparse` is off). No schedule beats it."""
    wire = profile.total_param_bytes
    if row_sparse:
        for layer in profile.layers:
            packed = (
                sparse_wire(layer.table, layer.param_bytes[0], workers)
                if layer.param_bytes
                else None
            )
            if packed is not None:
                wire -= layer.param_bytes[0] - packed
    comm = ring_allreduce_s(wire, workers, bandwidth_bytes_per_s, 0.0)
    return max(profile.compute_s * compute_factor, comm)


FREE_LINK = LinkModel(latency_s=0.0, collective_overhead_s=0.0, launch_s=0.0, ddp_launch_s=0.0)
DEPENDENCY_PARTITIONS = (256 << 10, 1 << 20, 4 << 20)


def dependency_bound_step_s(
    profile: ModelProfile, workers: int, bandwidth_bytes_per_s: float, credit_partitions: int = 4
) -> float:
    """The scheduler's best step on a link with no per-collective cost (FREE_LINK; partitions of
    DEPENDENCY_PARTITIONS, a credit window of `credit_partitions` of them). Above
    lower_bound_step_s by the data dependency alone: the first layers' gradients are ready last in
    backward and the next forward needs them first, so even a free link leaves their transfer
    exposed under the priority order (a tied embedding, ready only at the end of backward, most)."""
    sim = Simulator(profile, workers, PiecewiseConstant.constant(bandwidth_bytes_per_s), FREE_LINK)
    return min(
        sim.steady_step_s(Config(p, p * credit_partitions), bandwidth_bytes_per_s, steps=8)
        for p in DEPENDENCY_PARTITIONS
    )


@dataclasses.dataclass(frozen=True, slots=True)
class SimulatedStep:
    """What one simulated step looked like (mirrors the scheduler's per-step metrics)."""

    step: int
    start_s: float
    end_s: float
    step_time_s: float
    compute_s: float
    blocked_s: float  # exposed communication: forward waiting for parameters / DDP waiting
    comm_span_s: float  # backward start -> last all-reduce done
    bandwidth_bytes_per_s: float
    compute_factor: float
    partitions: int
    bytes_reduced: int
    config: RunConfig


@dataclasses.dataclass(frozen=True)
class _CommPlan:
    """The messages of one step for one configuration, in ready order."""

    ready_layer: tuple[int, ...]  # layer whose backward makes the message ready
    sizes: tuple[int, ...]
    priority: tuple[int, ...]
    credit_bytes: float
    launch_s: float
    is_ddp: bool
    # Layers (lowest, highest index) whose parameters a message carries; a layer's update waits for
    # every message that carries part of it. None: each message carries its ready_layer only.
    covers: tuple[tuple[int, int], ...] | None = None
    tail_bytes: float = 0.0  # the tail window (Config.tail_bytes); 0: none
    # Per message: (mask bytes, table bytes) of a row-sparse table (its `sizes` entry is the wire
    # bytes, mask included), (0, 0) for an ordinary partition; () when the step has none. The credit
    # window counts the wire bytes (the client counts the table whole: a difference only for what is
    # issued after the table, which is the step's last gradient in the models seen so far).
    sparse: tuple[tuple[int, int], ...] = ()

    @property
    def wire_bytes(self) -> int:
        """Bytes one step's collectives carry (what a rank reports as bytes_reduced)."""
        return sum(self.sizes)

    def layer_done(self, done: list[float], num_layers: int) -> np.ndarray:
        """Per-layer completion: the last message carrying part of the layer (-inf: none)."""
        layer_done = np.full(num_layers, -math.inf)
        if self.covers is None:
            np.maximum.at(layer_done, np.asarray(self.ready_layer), np.asarray(done))
            return layer_done
        for end, (low, high) in zip(done, self.covers):
            for layer in range(low, high + 1):
                layer_done[layer] = max(layer_done[layer], end)
        return layer_done


def _transfer_end(
    start: float,
    size: int,
    fixed_s: float,
    wire_factor: float,
    rate: float,
    trace: PiecewiseConstant | None,
    base_s: float,
    overlap: bool = False,
) -> float:
    """The link model, in one place: when a message of `size` bytes that starts at `start` has
    crossed the link (fixed per-collective cost, then size x ring factor at the bandwidth in force;
    with `overlap`, the later of the fixed cost's end and the bytes' end from `start`)."""
    if overlap:
        return max(
            start + fixed_s, _transfer_end(start, size, 0.0, wire_factor, rate, trace, base_s)
        )
    if trace is None:
        return start + fixed_s + size * wire_factor / rate
    return trace.integrate_until(base_s + start + fixed_s, size * wire_factor) - base_s


def _window(credit_bytes: float, unready_bytes: float, tail_bytes: float) -> float:
    """The bytes that may be in flight before the next issue: the credit, or in the tail window
    (0 < gradient bytes not yet ready <= tail_bytes) nothing: one collective at a time."""
    return 1.0 if 0 < unready_bytes <= tail_bytes else credit_bytes


def _dispatch(
    ready: list[float],
    sizes: tuple[int, ...],
    priority: tuple[int, ...],
    credit_bytes: float,
    launch_s: float,
    fixed_s: float | Sequence[float],
    wire_factor: float,
    rate: float,
    trace: PiecewiseConstant | None,
    base_s: float,
    tail_bytes: float = 0.0,
    overlap: bool = False,
) -> list[float]:
    """Completion time (relative to base_s) of every message; `ready` must be ascending.

    `fixed_s` is every message's cost besides the wire time (one number for all, or one each).
    With `trace` None the bandwidth is the constant `rate`; otherwise transfers are integrated over
    the trace at absolute time base_s + t.
    """
    count = len(ready)
    fixed = [fixed_s] * count if isinstance(fixed_s, (int, float)) else fixed_s
    done = [0.0] * count
    heap: list[tuple[int, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    inflight: deque[tuple[float, int]] = deque()
    inflight_bytes = 0
    unready = float(sum(sizes))
    index = 0
    t = ready[0]
    link_free = t
    while True:
        while inflight and inflight[0][0] <= t:
            inflight_bytes -= inflight.popleft()[1]
        while index < count and ready[index] <= t:
            push(heap, (priority[index], index))
            unready -= sizes[index]
            index += 1
        if not heap:
            if index >= count:
                return done
            t = ready[index]
            continue
        if inflight_bytes >= _window(credit_bytes, unready, tail_bytes):
            t = inflight[0][0]
            continue
        message = pop(heap)[1]
        launched = t + launch_s
        start = max(launched, link_free)
        size = sizes[message]
        end = _transfer_end(start, size, fixed[message], wire_factor, rate, trace, base_s, overlap)
        link_free = end
        done[message] = end
        inflight.append((end, size))
        inflight_bytes += size
        t = launched


def _advance(
    t: float, work: float, starts: list[float], ends: list[float], slowdown: float
) -> float:
    """When `work` seconds of compute started at `t` finish, running 1/slowdown as fast inside the
    busy intervals [starts[k], ends[k]) (sorted, disjoint)."""
    k = bisect_right(ends, t)
    while work > 0:
        if k >= len(starts):
            return t + work
        a, b = starts[k], ends[k]
        if t < a:  # free stretch before the next busy interval
            if t + work <= a:
                return t + work
            work -= a - t
            t = a
        # inside [t, b): progress 1/slowdown per second
        if t + work * slowdown <= b:
            return t + work * slowdown
        work -= (b - t) / slowdown
        t = b
        k += 1
    return t


def _dispatch_contended(
    backward: list[float],
    ready_layer: tuple[int, ...],
    sizes: tuple[int, ...],
    priority: tuple[int, ...],
    credit_bytes: float,
    launch_s: float,
    fixed_s: Sequence[float],
    wire_factor: float,
    rate: float,
    trace: PiecewiseConstant | None,
    base_s: float,
    slowdown: float,
    tail_bytes: float = 0.0,
    overlap: bool = False,
) -> tuple[list[float], float, list[float], list[float]]:
    """Backward pass and dispatcher together, compute slowed while the link is busy.

    `backward[i]` is layer i's backward work; layers run from the last to the first, and a
    message becomes ready when its layer's backward ends (`ready_layer` must be in that order).
    Returns every message's completion, the backward's end, and the link's busy intervals
    (starts, ends), all relative to the backward start (absolute time base_s + t under a trace).
    """
    count = len(sizes)
    done = [0.0] * count
    starts: list[float] = []
    ends: list[float] = []
    heap: list[tuple[int, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    inflight: deque[tuple[float, int]] = deque()
    inflight_bytes = 0.0
    unready = float(sum(sizes))
    link_free = 0.0
    dispatcher_t = 0.0  # the dispatcher thread is free from this time
    layer = len(backward) - 1
    layer_start = 0.0
    index = 0
    while True:
        layer_end = (
            _advance(layer_start, backward[layer], starts, ends, slowdown)
            if layer >= 0
            else math.inf
        )
        # The dispatcher's next issue among the messages ready so far.
        issue_t = math.inf
        if heap:
            issue_t = dispatcher_t
            while inflight and inflight[0][0] <= issue_t:
                inflight_bytes -= inflight.popleft()[1]
            window = _window(credit_bytes, unready, tail_bytes)
            if inflight_bytes >= window:
                # wait until enough credit frees (in-flight messages end in FIFO order)
                left = inflight_bytes
                for end, size in inflight:
                    left -= size
                    if left < window:
                        issue_t = max(issue_t, end)
                        break
        if issue_t < layer_end:
            while inflight and inflight[0][0] <= issue_t:
                inflight_bytes -= inflight.popleft()[1]
            message = pop(heap)[1]
            launched = issue_t + launch_s
            start = max(launched, link_free)
            size = sizes[message]
            end = _transfer_end(
                start, size, fixed_s[message], wire_factor, rate, trace, base_s, overlap
            )
            if starts and start <= ends[-1]:
                ends[-1] = end
            else:
                starts.append(start)
                ends.append(end)
            link_free = end
            done[message] = end
            inflight.append((end, size))
            inflight_bytes += size
            dispatcher_t = launched
            continue
        if layer < 0:
            return done, layer_start, starts, ends
        # layer `layer` finishes: its messages become ready
        while index < count and ready_layer[index] == layer:
            push(heap, (priority[index], index))
            unready -= sizes[index]
            index += 1
        dispatcher_t = max(dispatcher_t, layer_end)
        layer_start = layer_end
        layer -= 1


class Simulator:
    """Steps one data-parallel job forward in time; `step(config)` simulates one training step.

    `bandwidth` is in bytes/s per worker link (the job's share of the slowest link); `compute_trace`
    (optional) multiplies compute times (2.0 = the node became twice as slow). Optional conditions
    (all workers being identical, they describe the slowest one, which sets the pace of every
    collective): `flows_trace`, competing TCP flows on the link (each adds
    `LinkModel.flow_message_extra_s` to every collective; their bandwidth share is already out of
    `bandwidth`); `cpu_share_trace`, the cores the worker has (0.5 = half a core: compute 2x slower,
    and the communication's CPU load weighs twice as much, see `LinkModel.compute_slowdown`).
    `row_sparse=False`: the scheduler sends embedding tables whole (`sparse_rows=False`).
    """

    def __init__(
        self,
        profile: ModelProfile,
        workers: int,
        bandwidth: PiecewiseConstant,
        link: LinkModel = LinkModel(),
        compute_trace: PiecewiseConstant | None = None,
        *,
        flows_trace: PiecewiseConstant | None = None,
        cpu_share_trace: PiecewiseConstant | None = None,
        row_sparse: bool = True,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not profile.layers:
            raise ValueError("a profile needs at least one layer")
        self.profile = profile
        self.workers = workers
        self.row_sparse = (
            row_sparse  # the scheduler's row-sparse tables (ScheduledOptimizer(sparse_rows=))
        )
        self.bandwidth = bandwidth
        self.link = link
        self.compute_trace = compute_trace or PiecewiseConstant.constant(1.0)
        self.flows_trace = flows_trace
        self.cpu_share_trace = cpu_share_trace
        self.num_layers = len(profile.layers)
        forward = np.array([layer.forward_s for layer in profile.layers])
        backward = np.array([layer.backward_s for layer in profile.layers])
        self._forward_total = float(forward.sum())
        self._forward_before = np.cumsum(forward) - forward  # S_{i-1}
        self._backward_total = float(backward.sum())
        # Layer i's gradients are ready after the backward of layers i..L-1.
        self._ready_offset = np.cumsum(backward[::-1])[::-1].tolist()
        layer_bytes = np.array([layer.total_param_bytes for layer in profile.layers], dtype=float)
        total = layer_bytes.sum()
        self._optimizer_share = (
            profile.optimizer_s * layer_bytes / total if total > 0 else np.zeros(self.num_layers)
        )
        self._wire_factor = 2 * (workers - 1) / workers
        self._fixed: dict[tuple[RunConfig, float, float], tuple[float, ...]] = {}
        self._forward_list = forward.tolist()
        self._backward_list = backward.tolist()
        if link.comm_compute_slowdown < 1.0 or link.comm_cpu_s_per_byte < 0:
            raise ValueError("comm_compute_slowdown must be >= 1 and comm_cpu_s_per_byte >= 0")
        self._contended_model = link.comm_compute_slowdown != 1.0 or link.comm_cpu_s_per_byte > 0
        self._plans: dict[RunConfig, _CommPlan] = {}
        self._contended_cache: dict[tuple[RunConfig, float, float, float, float], tuple] = {}
        self._comm_cache: dict[
            tuple[RunConfig, float, float, float, float], tuple[np.ndarray, float]
        ] = {}
        self.reset()

    def conditions_at(self, t_s: float) -> tuple[float, float]:
        """(competing flows, CPU share) in force at t_s."""
        flows = self.flows_trace.at(t_s) if self.flows_trace is not None else 0.0
        share = self.cpu_share_trace.at(t_s) if self.cpu_share_trace is not None else 1.0
        return flows, share

    def compute_factor_at(self, t_s: float) -> float:
        """Compute-time multiplier at t_s: the compute trace over the CPU share."""
        _, share = self.conditions_at(t_s)
        return self.compute_trace.at(t_s) / share

    def _fixed_per_message(
        self, config: RunConfig, plan: _CommPlan, flows: float, share: float
    ) -> tuple[float, ...]:
        key = (config, flows, share)
        fixed = self._fixed.get(key)
        if fixed is None:
            fixed = tuple(
                self.link.message_s(size, self.workers, flows, share) for size in plan.sizes
            )
            if plan.sparse:  # the mask's collective and the zero test before it
                fixed = tuple(
                    f
                    + (
                        self.link.message_s(mask, self.workers, flows, share)
                        + table * SPARSE_SCAN_S_PER_BYTE
                        if mask
                        else 0.0
                    )
                    for f, (mask, table) in zip(fixed, plan.sparse)
                )
            self._fixed[key] = fixed
        return fixed

    # -- state -------------------------------------------------------------------------------

    def reset(self) -> None:
        self.now_s = 0.0
        self.step_index = 0
        self._param_ready = np.full(self.num_layers, -math.inf)
        # link busy intervals (absolute) of the last step and the slowdown in them (contended model)
        self._busy: tuple[list[float], list[float], float] = ([], [], 1.0)

    # -- configuration -> messages -------------------------------------------------------------

    def _plan(self, config: RunConfig) -> _CommPlan:
        plan = self._plans.get(config)
        if plan is not None:
            return plan
        layers = self.profile.layers
        ready_layer: list[int] = []
        sizes: list[int] = []
        priority: list[int] = []
        if isinstance(config, DDPConfig):
            # Reverse registration order; a bucket closes once it reaches its cap.
            bucket_bytes, bucket_layer, cap = 0, -1, config.first_bucket_bytes
            for layer_index in range(len(layers) - 1, -1, -1):
                for size in reversed(layers[layer_index].param_bytes):
                    bucket_bytes += size
                    bucket_layer = layer_index
                    if bucket_bytes >= cap:
                        ready_layer.append(bucket_layer)
                        sizes.append(bucket_bytes)
                        priority.append(len(priority))
                        bucket_bytes, cap = 0, config.bucket_bytes
            if bucket_bytes:
                ready_layer.append(bucket_layer)
                sizes.append(bucket_bytes)
                priority.append(len(priority))
            plan = _CommPlan(
                tuple(ready_layer),
                tuple(sizes),
                tuple(priority),
                math.inf,
                self.link.ddp_launch_s,
                True,
            )
        elif config.partition_bytes is None:
            # One message per tensor (the scheduler's "no partitioning").
            ordinal = 0
            per_layer: list[list[tuple[int, int, int | None]]] = []
            for layer in layers:  # forward order: priority ordinal increases with depth
                messages = []
                for k, size in enumerate(layer.param_bytes):
                    if size > 0:
                        messages.append((size, ordinal, self._sparse_wire(layer, k)))
                        ordinal += 1
                per_layer.append(messages)
            sparse: list[tuple[int, int]] = []
            for layer_index in range(len(layers) - 1, -1, -1):
                for piece, order, wire in per_layer[layer_index]:
                    ready_layer.append(layer_index)
                    sizes.append(piece if wire is None else wire)
                    sparse.append(
                        (0, 0) if wire is None else (layers[layer_index].table.rows, piece)
                    )  # type: ignore[union-attr]
                    priority.append(order)
            credit = math.inf if config.credit_bytes is None else float(config.credit_bytes)
            plan = _CommPlan(
                tuple(ready_layer),
                tuple(sizes),
                tuple(priority),
                credit,
                self.link.launch_s,
                False,
                sparse=tuple(sparse) if any(m for m, _ in sparse) else (),
            )
        else:
            plan = self._fused_plan(config)
        if isinstance(config, Config) and config.tail_bytes is not None:
            plan = dataclasses.replace(plan, tail_bytes=float(config.tail_bytes))
        self._plans[config] = plan
        return plan

    def _fused_plan(self, config: Config) -> _CommPlan:
        """Partitions as the real scheduler cuts them (client/autobyte/scheduler/layout.py): every
        gradient lies in one flat buffer in reverse forward order (the last layer's tensors at offset
        0), and partitions are fixed-size slices of that buffer, so a slice fuses small tensors and a
        big tensor spans several slices. A slice is ready when every tensor it overlaps has its
        gradient (the shallowest layer in it finishes its backward last); a higher offset is a
        higher priority; a layer is updated when every slice overlapping it is reduced."""
        partition = config.partition_bytes
        assert partition is not None
        spans: list[tuple[int, int, int]] = []  # (start, end, layer) in buffer order
        cuts: list[
            tuple[int, int, int, int]
        ] = []  # a row-sparse table: (start, end, wire bytes, rows)
        offset = 0
        for layer_index in range(len(self.profile.layers) - 1, -1, -1):
            layer = self.profile.layers[layer_index]
            for k in range(len(layer.param_bytes) - 1, -1, -1):
                size = layer.param_bytes[k]
                if size > 0:
                    wire = self._sparse_wire(layer, k)
                    if wire is not None:
                        cuts.append((offset, offset + size, wire, layer.table.rows))  # type: ignore[union-attr]
                    spans.append((offset, offset + size, layer_index))
                    offset += size
        total = offset

        # fixed-size slices from the end of the previous table, every table a slice of its own
        # (client/autobyte/scheduler/layout.py, Layout._template)
        def slices(
            a: int, b: int
        ) -> list[tuple[int, int, int, int]]:  # (start, end, wire bytes, mask bytes)
            return [
                (x, min(x + partition, b), min(x + partition, b) - x, 0)
                for x in range(a, b, partition)
            ]

        parts: list[tuple[int, int, int, int]] = []
        a = 0
        for start, end, wire, rows in cuts:
            parts += slices(a, start)
            parts.append((start, end, wire, rows))
            a = end
        parts += slices(a, total)
        count = len(parts)
        ready_layer, sizes, covers = [], [], []
        cursor = 0
        for start, end, wire, _ in parts:
            while spans[cursor][1] <= start:
                cursor += 1
            low = high = spans[cursor][2]
            probe = cursor
            while probe < len(spans) and spans[probe][0] < end:
                low = min(low, spans[probe][2])
                high = max(high, spans[probe][2])
                probe += 1
            ready_layer.append(low)
            sizes.append(wire)
            covers.append((low, high))
        priority = tuple(range(count - 1, -1, -1))
        credit = math.inf if config.credit_bytes is None else float(config.credit_bytes)
        sparse = tuple((mask, end - start) for start, end, _, mask in parts) if cuts else ()
        return _CommPlan(
            tuple(ready_layer),
            tuple(sizes),
            priority,
            credit,
            self.link.launch_s,
            False,
            tuple(covers),
            sparse=sparse,
        )

    def _sparse_wire(self, layer: LayerProfile, k: int) -> int | None:
        """The wire bytes of tensor k of `layer` when the scheduler reduces it row-sparse, else None."""
        if k != 0 or layer.table is None or not self.row_sparse:
            return None
        return sparse_wire(layer.table, layer.param_bytes[0], self.workers)

    def messages_per_step(self, config: RunConfig) -> int:
        return len(self._plan(config).sizes)

    # -- one step's communication ----------------------------------------------------------------

    def _comm(
        self,
        plan: _CommPlan,
        factor: float,
        rate: float,
        trace: PiecewiseConstant | None,
        base_s: float,
        fixed: Sequence[float],
    ) -> tuple[np.ndarray, float]:
        """Per-layer completion (relative to backward start; -inf when nothing to wait for; for DDP
        a single element: all done) and the span until the last message completes."""
        if not plan.sizes or self.workers <= 1:
            return (np.full(1 if plan.is_ddp else self.num_layers, -math.inf), 0.0)
        offsets = self._ready_offset
        ready = [offsets[layer] * factor for layer in plan.ready_layer]
        done = _dispatch(
            ready,
            plan.sizes,
            plan.priority,
            plan.credit_bytes,
            plan.launch_s,
            fixed,
            self._wire_factor,
            rate,
            trace,
            base_s,
            plan.tail_bytes,
            self.link.fixed_overlaps_wire,
        )
        span = max(done)
        if plan.is_ddp:
            return np.array([span]), span
        return plan.layer_done(done, self.num_layers), span

    def _comm_at(
        self, config: RunConfig, plan: _CommPlan, factor: float, backward_start_s: float
    ) -> tuple[np.ndarray, float, float]:
        rate = self.bandwidth.at(backward_start_s)
        flows, share = self.conditions_at(backward_start_s)
        fixed = self._fixed_per_message(config, plan, flows, share)
        key = (config, rate, factor, flows, share)
        cached = self._comm_cache.get(key)
        if cached is None:
            cached = self._comm(plan, factor, rate, None, 0.0, fixed)
            self._comm_cache[key] = cached
        if backward_start_s + cached[1] <= self.bandwidth.next_change(backward_start_s):
            return cached[0], cached[1], rate
        exact = self._comm(plan, factor, rate, self.bandwidth, backward_start_s, fixed)
        return exact[0], exact[1], rate

    def _contended(
        self,
        plan: _CommPlan,
        factor: float,
        rate: float,
        trace: PiecewiseConstant | None,
        base_s: float,
        fixed: Sequence[float],
        share: float,
    ) -> tuple[np.ndarray, float, float, list[float], list[float]]:
        """Like _comm, with compute slowed while the link is busy: also the backward's duration
        and the link's busy intervals, all relative to the backward start."""
        backward = [b * factor for b in self._backward_list]
        if not plan.sizes or self.workers <= 1:
            return (
                np.full(1 if plan.is_ddp else self.num_layers, -math.inf),
                0.0,
                sum(backward),
                [],
                [],
            )
        done, backward_s, starts, ends = _dispatch_contended(
            backward,
            plan.ready_layer,
            plan.sizes,
            plan.priority,
            plan.credit_bytes,
            plan.launch_s,
            fixed,
            self._wire_factor,
            rate,
            trace,
            base_s,
            self.link.compute_slowdown(rate, share),
            plan.tail_bytes,
            self.link.fixed_overlaps_wire,
        )
        span = max(done)
        if plan.is_ddp:
            return np.array([span]), span, backward_s, starts, ends
        return plan.layer_done(done, self.num_layers), span, backward_s, starts, ends

    def _contended_at(
        self, config: RunConfig, plan: _CommPlan, factor: float, backward_start_s: float
    ) -> tuple[Any, ...]:
        rate = self.bandwidth.at(backward_start_s)
        flows, share = self.conditions_at(backward_start_s)
        fixed = self._fixed_per_message(config, plan, flows, share)
        key = (config, rate, factor, flows, share)
        cached = self._contended_cache.get(key)
        if cached is None:
            cached = self._contended(plan, factor, rate, None, 0.0, fixed, share)
            self._contended_cache[key] = cached
        if backward_start_s + cached[1] <= self.bandwidth.next_change(backward_start_s):
            return (*cached, rate, share)
        return (
            *self._contended(plan, factor, rate, self.bandwidth, backward_start_s, fixed, share),
            rate,
            share,
        )

    def _step_contended(self, config: RunConfig, plan: _CommPlan) -> SimulatedStep:
        """step() with compute slowed while the link is busy (LinkModel.compute_slowdown)."""
        start = self.now_s
        factor = self.compute_factor_at(start)
        busy_starts, busy_ends, slowdown = self._busy
        t, blocked = start, 0.0
        for i, work in enumerate(self._forward_list):
            ready = self._param_ready[i]
            if ready > t:
                blocked += ready - t
                t = ready
            t = _advance(t, work * factor, busy_starts, busy_ends, slowdown)
        backward_start = t
        layer_done, span, backward_s, starts, ends, rate, share = self._contended_at(
            config, plan, factor, backward_start
        )
        backward_end = backward_start + backward_s
        compute = backward_start - start - blocked + backward_s
        if plan.is_ddp:
            comm_end = backward_start + float(layer_done[0])
            next_start = max(backward_end, comm_end) + self.profile.optimizer_s * factor
            blocked += next_start - backward_end - self.profile.optimizer_s * factor
            self._param_ready = np.full(self.num_layers, -math.inf)
            self._busy = ([], [], 1.0)
        else:
            next_start = backward_end
            self._param_ready = backward_start + layer_done + self._optimizer_share * factor
            self._busy = (
                [backward_start + a for a in starts],
                [backward_start + b for b in ends],
                self.link.compute_slowdown(rate, share),
            )
        record = SimulatedStep(
            self.step_index,
            start,
            next_start,
            next_start - start,
            compute,
            blocked,
            span,
            rate,
            factor,
            len(plan.sizes),
            plan.wire_bytes,
            config,
        )
        self.now_s = next_start
        self.step_index += 1
        return record

    # -- stepping ----------------------------------------------------------------------------

    def step(self, config: RunConfig) -> SimulatedStep:
        """Simulate one training step under `config` and advance the clock."""
        plan = self._plan(config)
        if self._contended_model:
            return self._step_contended(config, plan)
        start = self.now_s
        factor = self.compute_factor_at(start)
        forward_total = self._forward_total * factor
        backward_total = self._backward_total * factor
        # f_end_i = max(f_end_{i-1}, u_i) + F_i  ==  S_i + cummax(max(u_i - S_{i-1}, t0))
        lead = np.maximum(self._param_ready - self._forward_before * factor, start)
        backward_start = float(lead.max()) + forward_total
        blocked = backward_start - start - forward_total
        backward_end = backward_start + backward_total
        layer_done, span, rate = self._comm_at(config, plan, factor, backward_start)
        if plan.is_ddp:
            comm_end = backward_start + float(layer_done[0])
            next_start = max(backward_end, comm_end) + self.profile.optimizer_s * factor
            blocked += next_start - backward_end - self.profile.optimizer_s * factor
            self._param_ready = np.full(self.num_layers, -math.inf)
        else:
            next_start = backward_end
            self._param_ready = backward_start + layer_done + self._optimizer_share * factor
        record = SimulatedStep(
            self.step_index,
            start,
            next_start,
            next_start - start,
            forward_total + backward_total,
            blocked,
            span,
            rate,
            factor,
            len(plan.sizes),
            plan.wire_bytes,
            config,
        )
        self.now_s = next_start
        self.step_index += 1
        return record

    def run(
        self, config: RunConfig, steps: int | None = None, until_s: float | None = None
    ) -> list[SimulatedStep]:
        """Run one fixed configuration for `steps` steps or until the clock passes `until_s`."""
        if (steps is None) == (until_s is None):
            raise ValueError("give exactly one of steps or until_s")
        records = []
        if steps is not None:
            for _ in range(steps):
                records.append(self.step(config))
        else:
            while self.now_s < until_s:
                records.append(self.step(config))
        return records

    def steady_step_s(
        self,
        config: RunConfig,
        bandwidth_bytes_per_s: float,
        compute_factor: float = 1.0,
        flows: float = 0.0,
        cpu_share: float = 1.0,
        *,
        steps: int = 4,
    ) -> float:
        """Step time once constant conditions have settled (the oracle's view): the job's bandwidth,
        the compute trace's factor, competing flows and the CPU share."""
        saved = (
            self.now_s,
            self.step_index,
            self._param_ready,
            self.bandwidth,
            self.compute_trace,
            self.flows_trace,
            self.cpu_share_trace,
            self._busy,
        )
        try:
            self.bandwidth = PiecewiseConstant.constant(bandwidth_bytes_per_s)
            self.compute_trace = PiecewiseConstant.constant(compute_factor)
            self.flows_trace = (
                PiecewiseConstant.constant(flows, nonnegative=True) if flows else None
            )
            self.cpu_share_trace = (
                PiecewiseConstant.constant(cpu_share) if cpu_share != 1.0 else None
            )
            self.reset()
            record = None
            for _ in range(steps):
                record = self.step(config)
            assert record is not None
            return record.step_time_s
        finally:
            (
                self.now_s,
                self.step_index,
                self._param_ready,
                self.bandwidth,
                self.compute_trace,
                self.flows_trace,
                self.cpu_share_trace,
                self._busy,
            ) = saved

    def lower_bound_step_s(self, t_s: float) -> float:
        return lower_bound_step_s(
            self.profile,
            self.workers,
            self.bandwidth.at(t_s),
            self.compute_factor_at(t_s),
            self.row_sparse,
        )
