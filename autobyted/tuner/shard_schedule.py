"""FSDP2's step as a schedule: each group's all-gather and reduce-scatter on the link, the training
thread waiting where FSDP2 waits, under a configuration of its knobs (autobyte.fsdp.ShardConfig:
forward and backward prefetch depth, resharding after forward).

The model (one rank; every rank runs the same schedule):

- Groups in forward order (a transformer's blocks, `block_of`), and the root: the layers outside
  any block, gathered once at the start of forward and kept until the end of backward (FSDP2
  never reshards the root after forward), its compute before the first block (embeddings) and
  after the last (final norm, LM head).
- Forward, group i: FSDP2's pre-forward gathers i if no prefetch did, waits for it, then issues
  the all-gathers of the next `forward_prefetch` groups; computes; frees the gathered parameters
  if i reshards after forward. Backward, in reverse: the pre-backward gathers i again if it was
  freed, waits, issues the next `backward_prefetch` groups' (FSDP2's default: 1); computes; its
  post-backward reduce-scatters i's gradients. The root's gradients are reduce-scattered last.
- The link: one rank's collectives one after another in the order issued (FIFO), each taking
  `fixed_s` plus its bytes at the rate: an all-gather moves (N-1)/N of the group's bytes, a
  reduce-scatter `rs_factor` times that (1 on a ring such as NCCL's; 2 on gloo, whose
  reduce-scatter costs an all-reduce: docs/emulated.md).
- The thread: compute holds it (an emulated device, as a GPU without run-ahead); a collective
  that `holds_the_thread` blocks it from issue to end: on gloo, FSDP2's own all-gathers
  (`sync_all_gathers`) and its reduce-scatters (`sync_reduce_scatters`); autobyte.fsdp's
  asynchronous all-gathers return at once and are waited at use. With asynchronous
  reduce-scatters (a GPU's stream) the step ends when the last one does.

What it leaves out: memory (ShardedJob.gathered_bytes predicts the gathered bytes), the optimizer
step, the CPU's share of gloo's work, collectives overlapping on the link (they share it; here
they queue, which gives the same finish of the last one). Checked against the emulated testbed by
benchmarks/sim_vs_fsdp.py (docs/results.md, "FSDP2's schedule in the simulator": 1.7% median
error at 2 ranks, 3.6% at 4, 5-11% at 8), where each group's compute comes from the profile.

The daemon's tuner uses it (autobyted/tuner/sharded.py) through `JobSchedule`: a job registers its
groups' bytes (autobyte.records.ShardLayout), not their compute, so `calibrate` fits the model
to one measured configuration (the compute is the step less the time in collectives, split by
bytes; the rate is the one at which the schedule takes the measured step) and `predict` gives
every other configuration's step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from autobyte.records import ShardLayout
from autobyte.types import Config

if TYPE_CHECKING:  # the simulator's profiles (simulator/profiles.py) are not in the wheel
    from simulator.profiles import ModelProfile

DEFAULT_BACKWARD_PREFETCH = 1  # FSDP2 prefetches the next group's all-gather in backward


def block_of(name: str) -> str | None:
    """A layer's transformer block (`h.3.attn.c_attn` -> `h.3`); None outside blocks."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else None


@dataclasses.dataclass(frozen=True)
class ShardGroup:
    name: str
    param_bytes: int
    forward_s: float
    backward_s: float


@dataclasses.dataclass(frozen=True)
class ShardedModel:
    """A model as FSDP2 groups it: `groups` in forward order, and the root's own parameters and
    compute (before the first group and after the last)."""

    groups: tuple[ShardGroup, ...]
    root_bytes: int
    root_forward_s: tuple[float, float]  # (before the groups, after them)
    root_backward_s: tuple[float, float]

    @classmethod
    def from_profile(cls, profile: ModelProfile) -> ShardedModel:
        """One group per transformer block of `profile` (its layers named `h.N....`)."""
        groups: list[ShardGroup] = []
        root_bytes = 0
        root_f, root_b = [0.0, 0.0], [0.0, 0.0]
        for layer in profile.layers:
            block = block_of(layer.name)
            if block is None:
                side = 1 if groups else 0
                root_bytes += layer.total_param_bytes
                root_f[side] += layer.forward_s
                root_b[side] += layer.backward_s
            elif groups and groups[-1].name == block:
                last = groups[-1]
                groups[-1] = ShardGroup(
                    block,
                    last.param_bytes + layer.total_param_bytes,
                    last.forward_s + layer.forward_s,
                    last.backward_s + layer.backward_s,
                )
            else:
                groups.append(
                    ShardGroup(block, layer.total_param_bytes, layer.forward_s, layer.backward_s)
                )
        if not groups:
            raise ValueError(f"profile {profile.name!r} has no transformer blocks (h.N layers)")
        return cls(tuple(groups), root_bytes, (root_f[0], root_f[1]), (root_b[0], root_b[1]))

    @property
    def compute_s(self) -> float:
        return (
            sum(g.forward_s + g.backward_s for g in self.groups)
            + sum(self.root_forward_s)
            + sum(self.root_backward_s)
        )

    def scaled(self, factor: float) -> ShardedModel:
        """Every compute time times `factor` (a measured compute probe over the profile's)."""
        return ShardedModel(
            tuple(
                dataclasses.replace(
                    g, forward_s=g.forward_s * factor, backward_s=g.backward_s * factor
                )
                for g in self.groups
            ),
            self.root_bytes,
            (self.root_forward_s[0] * factor, self.root_forward_s[1] * factor),
            (self.root_backward_s[0] * factor, self.root_backward_s[1] * factor),
        )


@dataclasses.dataclass(frozen=True)
class ShardLink:
    """One rank's link and its backend (the module docstring)."""

    bytes_per_s: float
    workers: int
    fixed_s: float = 0.0  # per collective besides its bytes
    rs_factor: float = 1.0  # a reduce-scatter's bytes over an all-gather's: 2 on gloo
    sync_all_gathers: bool = False  # FSDP2's own all-gathers on gloo hold the thread
    sync_reduce_scatters: bool = True  # on gloo; False on a GPU's stream
    # The fixed cost overlaps the bytes' time (a collective holds the link for the larger of the
    # two), as the scheduler's simulator has it on the testbed at N ranks (simulator/engine.py
    # LinkModel.fixed_overlaps_wire); False: their sum.
    fixed_overlaps_wire: bool = False

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {self.bytes_per_s}")
        if self.workers < 2:
            raise ValueError(f"workers must be >= 2, got {self.workers}")

    def all_gather_s(self, nbytes: int) -> float:
        return self._cost((self.workers - 1) / self.workers * nbytes / self.bytes_per_s)

    def reduce_scatter_s(self, nbytes: int) -> float:
        return self._cost(
            self.rs_factor * (self.workers - 1) / self.workers * nbytes / self.bytes_per_s
        )

    def _cost(self, wire_s: float) -> float:
        if self.fixed_overlaps_wire:
            return max(self.fixed_s, wire_s)
        return self.fixed_s + wire_s


@dataclasses.dataclass(frozen=True)
class ShardedStep:
    step_s: float
    all_gather_wait_s: float  # the thread's time in all-gathers (issue and wait)
    reduce_scatter_wait_s: float
    all_gathers: int


class _Link:
    """Collectives queued on the link in the order issued."""

    def __init__(self) -> None:
        self.free_at = 0.0

    def run(self, issued_at: float, duration_s: float) -> float:
        start = max(issued_at, self.free_at)
        self.free_at = start + duration_s
        return self.free_at


def simulate_step(
    model: ShardedModel,
    link: ShardLink,
    forward_prefetch: int | None = None,
    backward_prefetch: int | None = None,
    reshard_after_forward: bool | Sequence[bool | None] | None = None,
) -> ShardedStep:
    """One step of `model` under FSDP2's knobs (None: as `fully_shard` leaves them: no explicit
    forward prefetch, backward prefetch 1, every group resharding after forward)."""
    n = len(model.groups)
    if isinstance(reshard_after_forward, Sequence):
        if len(reshard_after_forward) != n:
            raise ValueError(
                f"reshard_after_forward names {len(reshard_after_forward)} groups; the model has {n}"
            )
        reshard = [True if r is None else bool(r) for r in reshard_after_forward]
    else:
        reshard = [True if reshard_after_forward is None else bool(reshard_after_forward)] * n
    forward = forward_prefetch or 0
    backward = DEFAULT_BACKWARD_PREFETCH if backward_prefetch is None else backward_prefetch
    if forward < 0 or backward < 0:
        raise ValueError(
            f"prefetch depths must be >= 0, got {forward_prefetch}, {backward_prefetch}"
        )

    wire = _Link()
    t = 0.0
    ag_wait = rs_wait = 0.0
    gathers = 0
    done: dict[int, float] = {}  # group -> when its pending all-gather ends

    def gather(i: int, at: float) -> float:
        """Issue group i's all-gather at `at`; the thread's time after issuing it."""
        nonlocal gathers, ag_wait
        gathers += 1
        end = wire.run(at, link.all_gather_s(model.groups[i].param_bytes))
        done[i] = end
        if link.sync_all_gathers:
            ag_wait += end - at
            return end
        return at

    def wait(i: int, at: float) -> float:
        nonlocal ag_wait
        end = done.pop(i)
        if end > at:
            ag_wait += end - at
            return end
        return at

    # forward: the root, then each group
    root_end = wire.run(t, link.all_gather_s(model.root_bytes)) if model.root_bytes else t
    gathers += 1 if model.root_bytes else 0
    ag_wait += root_end - t
    t = root_end + model.root_forward_s[0]
    gathered = [False] * n
    for i in range(n):
        if i not in done and not gathered[i]:
            t = gather(i, t)
        if i in done:
            t = wait(i, t)
        gathered[i] = True
        for j in range(i + 1, min(n, i + 1 + forward)):
            if j not in done and not gathered[j]:
                t = gather(j, t)
        t += model.groups[i].forward_s
        if reshard[i]:
            gathered[i] = False
    t += model.root_forward_s[1]
    # backward: the root's head, then the groups in reverse, each reduce-scattered after it
    t += model.root_backward_s[1]
    last_rs = t
    for i in reversed(range(n)):
        if not gathered[i] and i not in done:
            t = gather(i, t)
        if i in done:
            t = wait(i, t)
        gathered[i] = True
        for j in range(i - 1, max(-1, i - 1 - backward), -1):
            if j not in done and not gathered[j]:
                t = gather(j, t)
        t += model.groups[i].backward_s
        end = wire.run(t, link.reduce_scatter_s(model.groups[i].param_bytes))
        last_rs = end
        if link.sync_reduce_scatters:
            rs_wait += end - t
            t = end
    t += model.root_backward_s[0]
    if model.root_bytes:
        end = wire.run(t, link.reduce_scatter_s(model.root_bytes))
        last_rs = end
        if link.sync_reduce_scatters:
            rs_wait += end - t
            t = end
    return ShardedStep(max(t, last_rs), ag_wait, rs_wait, gathers)


# ---------------------------------------------------------------------------- the daemon's model
FORWARD_SHARE = 1 / 3  # a layer's forward in its forward + backward (backward: two matmuls a one)
RATE_BOUNDS = (1e3, 1e13)  # bytes/s the calibration searches: 8 kbit/s .. 80 Tbit/s
RATE_ITERATIONS = 60  # bisections in log rate: 2**-60 of the bounds' ratio, far below any noise


@dataclasses.dataclass(frozen=True)
class JobSchedule:
    """What the daemon knows of an FSDP2 job to predict its steps: its groups (its registration's
    autobyte.records.ShardLayout), world size, backend and per-collective cost. The compute
    between collectives is not registered: `calibrate` splits a measured step's compute over the
    groups by their bytes (a transformer's blocks are alike; its head, in the root, computes in
    proportion to its bytes too), FORWARD_SHARE of it in forward, the root's after the groups."""

    layout: ShardLayout
    world_size: int
    backend: str
    collective_latency_s: float = 0.0

    def model(self, compute_s: float) -> ShardedModel:
        layout = self.layout
        per_byte = compute_s / (layout.root_bytes + sum(layout.group_bytes))
        f, b = FORWARD_SHARE * per_byte, (1 - FORWARD_SHARE) * per_byte
        groups = tuple(
            ShardGroup(str(i), n, n * f, n * b) for i, n in enumerate(layout.group_bytes)
        )
        root = layout.root_bytes
        return ShardedModel(groups, root, (0.0, root * f), (0.0, root * b))

    def link(self, bytes_per_s: float) -> ShardLink:
        gloo = self.backend == "gloo"  # collectives hold the thread; a reduce-scatter all-reduces
        return ShardLink(
            bytes_per_s,
            self.world_size,
            fixed_s=self.collective_latency_s,
            rs_factor=2.0 if gloo else 1.0,
            sync_all_gathers=gloo and not self.layout.async_gathers,
            sync_reduce_scatters=gloo,
        )

    def calibrate(self, config: Config, step_s: float, exposed_s: float) -> Calibrated | None:
        """The job's model fitted to one measured configuration: its compute (the step less the
        time in collectives) and the rate at which the schedule takes the step measured. None
        where that is not a step this model can take (no compute, one rank)."""
        compute = step_s - exposed_s
        if self.world_size < 2 or not (compute > 0 and math.isfinite(step_s)):
            return None
        model = self.model(compute)

        def step_at(rate: float) -> float:
            return _simulate(model, self.link(rate), config).step_s

        lo, hi = (math.log(r) for r in RATE_BOUNDS)
        if step_at(math.exp(hi)) >= step_s:  # the collectives are hidden: as fast as the bound
            return Calibrated(self, model, math.exp(hi))
        for _ in range(RATE_ITERATIONS):
            mid = (lo + hi) / 2
            if step_at(math.exp(mid)) > step_s:
                lo = mid
            else:
                hi = mid
        return Calibrated(self, model, math.exp(hi))


@dataclasses.dataclass(frozen=True)
class Calibrated:
    schedule: JobSchedule
    model: ShardedModel
    bytes_per_s: float

    def predict(self, config: Config) -> float:
        """`config`'s step time under the calibrated compute and rate."""
        return _simulate(self.model, self.schedule.link(self.bytes_per_s), config).step_s


def _simulate(model: ShardedModel, link: ShardLink, config: Config) -> ShardedStep:
    return simulate_step(
        model,
        link,
        config.forward_prefetch,
        config.backward_prefetch,
        config.reshard_after_forward,
    )
