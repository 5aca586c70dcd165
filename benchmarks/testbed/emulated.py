"""An emulated accelerator for the testbed: a model whose layers take a profile's compute time as a
wait that holds no CPU and no GIL, and produce real gradients of the profile's sizes in its order.

Only the arithmetic is emulated. Each layer of a `simulator.profiles.ModelProfile` (the FLOP-derived
ResNet-50, BERT-base, VGG-16 and GPT-2 profiles at a device throughput, or one recorded from a real
model) becomes an `EmulatedLayer` module that owns parameters of the layer's tensor sizes (1-D, in
the profile's order, divided by `byte_scale`). Its forward waits `forward_s` and its backward waits
`backward_s` on the rank's `EmulatedDevice`, then returns each parameter's gradient as a constant
fill (a cheap memory write, no arithmetic); an embedding table's (`EmulatedTable`) fills only the
rows a batch looked up. Everything else is the real thing: autograd's
AccumulateGrad and post-accumulate-grad hooks fire as the layers' gradients appear, so DDP's reducer,
the scheduler (both hot paths), gloo, the testbed's veth links with tc, the reporter and autobyted
run exactly as they do for a real model. The optimizer's update is real host work on the scaled
tensors (the profile's `optimizer_s` is not waited).

The scale: `byte_scale` divides every tensor's element count (and the testbed divides the link's
rate by it, `benchmarks.harness.scenario.Scenario.testbed_trace`), so that a model of 100 MB crosses 2-core
veth links in the time a real cluster's link takes, and the host's per-collective costs keep a GPU
cluster's proportion to the step; the device's throughput (`device_flops_per_s` x `compute_scale`)
sets the step's compute. Every table from this mode states both.

The waits: `time.sleep` oversleeps by ~80-200 us here, a step has 50-300 waits, and the host's own
Python between two layers takes ~50 us; on a GPU the host launches kernels ahead of the device, so
neither would add to the step. `EmulatedDevice` keeps the host's launch clock and the device's
apart (its docstring): a wait runs on the device from max(its launch, the previous wait's end), so
oversleeps and overlappable host work do not add up, while a host that is really held up (a forward
blocked on a parameter's update, a rank without a CPU) delays the device, as it would a GPU's.

    workload = build_emulated("resnet50", compute_scale=50, byte_scale=16)   # benchmarks.testbed.models.build
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from autobyte.scheduler import sparse_rows
from torch import nn

from benchmarks.testbed.workload import Workload
from simulator.profiles import (
    BYTES_PER_PARAM,
    DEFAULT_DEVICE_FLOPS_PER_S,
    LayerProfile,
    ModelProfile,
    RowSparseTable,
    load_profile,
)

_PR_SET_TIMERSLACK = 29  # prctl(2): the thread's timer slack in ns (default 50 us)


# A gap between two waits of one thread that was more than this much off-CPU (blocked on a
# parameter's update, or descheduled) is a real delay of the host: the device waits for it.
BLOCKED_GAP_S = 200e-6
# How far the launch clock may run ahead of the present (a GPU's launch queue runs ahead until a
# sync; bounded here so that host work is never hidden behind more than this much device work).
MAX_LAUNCH_LEAD_S = 5e-3


class EmulatedDevice:
    """One rank's device, launched asynchronously as a GPU's stream is (see the module docstring).

    Two clocks: the host's launch clock and the device's. The host's time between two waits (its
    Python, the hooks, a gradient's fill: time on the CPU, read with `time.thread_time`) advances
    the launch clock; a wait starts on the device at max(its launch, the previous wait's end) and
    the calling thread sleeps until it ends. When the host was off the CPU for longer than
    BLOCKED_GAP_S between two waits (a forward blocked on a parameter's update, a descheduled
    rank), the launch clock jumps to the present: that delay is the host's, and it shows; nor does
    it run more than MAX_LAUNCH_LEAD_S behind the present. So the
    sleep's oversleep (the wake-up is measured) and host work the device would have overlapped do
    not add up over a step, and every real wait of the host still does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._launch = 0.0  # the host's launch clock (time.perf_counter)
        self._free_at = 0.0  # when the previous wait ends on the device
        self._thread = threading.local()  # per thread: (wall, cpu) at its last wake-up
        self.busy_s = 0.0  # device time given out (the profile's sum for the waits made)
        self.waits = 0
        self.idle_waits = 0  # waits the device had to wait for: the host launched them late
        self.idle_s = 0.0  # the device's idle time before those waits
        self.oversleep_total_s = 0.0

    def _tight_timer(self) -> None:
        """Timer slack of 1 ns on the calling thread (Linux; elsewhere the default stays)."""
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def wait(self, duration_s: float) -> None:
        """Hold the calling thread until `duration_s` of device time, launched now, has run."""
        now, cpu = time.perf_counter(), time.thread_time()
        last = getattr(self._thread, "last", None)
        if last is None:
            self._tight_timer()
        with self._lock:
            if last is None or (now - last[0]) - (cpu - last[1]) > BLOCKED_GAP_S:
                launch = now  # the host was held up: the device waits for it
            else:
                launch = max(self._launch + (now - last[0]), now - MAX_LAUNCH_LEAD_S)
            self._launch = launch
            start = max(launch, self._free_at)
            if start > self._free_at and self.waits:
                self.idle_waits += 1
                self.idle_s += start - self._free_at
            end = start + duration_s
            self._free_at = end
            self.busy_s += duration_s
            self.waits += 1
        while now < end:
            time.sleep(end - now)  # releases the GIL
            now = time.perf_counter()
        with self._lock:
            self.oversleep_total_s += max(0.0, now - end)
        self._thread.last = (now, time.thread_time())

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "busy_s": self.busy_s,
                "waits": self.waits,
                "idle_waits": self.idle_waits,
                "idle_s": self.idle_s,
                "oversleep_total_s": self.oversleep_total_s,
            }


# One rank is one process with one device: every emulated model of the process (DDP's replicas and
# the scheduler's) computes on it.
DEVICE = EmulatedDevice()


def gradient_fill(layer_index: int, rank: int) -> float:
    """The constant every gradient element of a layer gets: a dyadic fraction, so sums of them are
    exact and every rank's gradient differs (the all-reduce's result is checkable)."""
    return float((layer_index % 13) + 1 + rank) / 1024.0


class _LayerCompute(torch.autograd.Function):
    """The layer's forward and backward as device waits; gradients are constant fills."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: _Emulated, *params: torch.Tensor) -> torch.Tensor:
        ctx.layer = layer
        ctx.shapes = [(p.shape, p.dtype) for p in params]
        layer.device.wait(layer.forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        layer: _Emulated = ctx.layer
        value = gradient_fill(layer.index, layer.rank())
        grads = [
            torch.empty(shape, dtype=dtype).fill_(value) if needed else None
            for (shape, dtype), needed in zip(ctx.shapes, ctx.needs_input_grad[2:])
        ]
        if layer.table is not None and grads[0] is not None:
            keep = layer.table_rows()
            if keep is not None:  # the rows this batch did not look up are zero
                sparse = torch.zeros_like(grads[0])
                sparse[keep] = value
                grads[0] = sparse
        layer.device.wait(layer.backward_s)
        return (grad_out if ctx.needs_input_grad[0] else None, None, *grads)


class _Emulated:
    """What an emulated layer is, whatever module class it is (`EmulatedLayer`, `EmulatedTable`):
    parameters of the profile's tensor sizes, read through the module (as the scheduler's first-use
    tracking expects), a forward and a backward of the profile's times."""

    index: int
    table: RowSparseTable | None

    def _emulate(
        self, index: int, profile: LayerProfile, byte_scale: float, device: EmulatedDevice
    ) -> None:
        self.index = index
        self.profile_name = profile.name
        self.forward_s = profile.forward_s
        self.backward_s = profile.backward_s
        self.device = device
        self.table = None
        self._backwards = 0  # which batch: the rows a table's gradient holds change with it
        names = (
            ["weight", "bias"]
            if len(profile.param_bytes) <= 2
            else [f"p{k}" for k in range(len(profile.param_bytes))]
        )
        self.param_names = names[: len(profile.param_bytes)]
        for name, nbytes in zip(self.param_names, profile.param_bytes):
            if not hasattr(self, name):  # an EmulatedTable's weight is already its table
                self.register_parameter(  # type: ignore[attr-defined]
                    name, nn.Parameter(torch.zeros(scaled_elements(nbytes, byte_scale)))
                )

    @staticmethod
    def rank() -> int:
        dist = torch.distributed
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def parameter_list(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.param_names]

    def table_rows(self) -> torch.Tensor | None:
        """Overridden by tables: the rows this rank's batch looked up."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LayerCompute.apply(x, self, *self.parameter_list())


class EmulatedLayer(_Emulated, nn.Module):
    """One profile layer (`_Emulated`), its tensors 1-D."""

    def __init__(
        self, index: int, profile: LayerProfile, byte_scale: float, device: EmulatedDevice
    ) -> None:
        nn.Module.__init__(self)
        self._emulate(index, profile, byte_scale, device)


class EmulatedTable(_Emulated, nn.Embedding):
    """A profile layer whose first tensor is an embedding table (`LayerProfile.table`): an
    `nn.Embedding` of the table's rows divided by `byte_scale` (its row width the profile's), so the
    scheduler reduces it row-sparse where it would the real model's
    (client/autobyte/scheduler/sparse_rows.py). Each backward, a rank's gradient is non-zero in the
    rows its batch looked up (`table_rows`): the same `share` of the rows the profile gives, the
    `overlap` of them common to every rank (positions), the rest drawn per rank and batch."""

    def __init__(
        self, index: int, profile: LayerProfile, byte_scale: float, device: EmulatedDevice
    ) -> None:
        table = profile.table
        assert table is not None
        width = max(1, profile.param_bytes[0] // BYTES_PER_PARAM // table.rows)
        nn.Embedding.__init__(self, max(1, math.ceil(table.rows / byte_scale)), width)
        with torch.no_grad():
            self.weight.zero_()
        self._emulate(index, profile, byte_scale, device)
        self.table = table

    def table_rows(self) -> torch.Tensor | None:
        assert self.table is not None
        rows = self.num_embeddings
        common = round(self.table.share * self.table.overlap * rows)
        own = round(self.table.share * rows) - common
        self._backwards += 1
        if common + own >= rows:
            return None  # every row
        # the same draw on a rank for a batch in every run (DDP's replica and the scheduler's)
        generator = torch.Generator().manual_seed(
            (self.index * 1_000_003 + self.rank()) * 1_000_003 + self._backwards
        )
        drawn = torch.randperm(rows - common, generator=generator)[:own] + common
        return torch.cat([torch.arange(common), drawn])


class EmulatedModel(nn.Module):
    """The profile's layers in forward order; the input is a 1-element tensor carried through."""

    def __init__(self, profile: ModelProfile, byte_scale: float = 1.0) -> None:
        super().__init__()
        if not profile.layers:
            raise ValueError(f"profile {profile.name!r} has no layers")
        self.profile = profile
        self.byte_scale = byte_scale
        self.device = DEVICE
        self.layers = nn.ModuleList(
            (EmulatedTable if layer.table is not None else EmulatedLayer)(
                k, layer, byte_scale, self.device
            )
            for k, layer in enumerate(profile.layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def scaled_elements(nbytes: int, byte_scale: float) -> int:
    """Elements of a tensor of `nbytes` (fp32) with its size divided by `byte_scale` (at least 1)."""
    return max(1, math.ceil(nbytes / BYTES_PER_PARAM / byte_scale))


def emulated_profile(
    profile: str,
    batch_size: int | None = None,
    device_flops_per_s: float = DEFAULT_DEVICE_FLOPS_PER_S,
    compute_scale: float = 1.0,
) -> ModelProfile:
    """The profile as the simulator loads it (a built-in name or a recorded JSON), then scaled."""
    return load_profile(profile, batch_size, device_flops_per_s).scaled(compute_scale)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.sum()


def build_emulated(
    profile: str = "resnet50",
    batch_size: int | None = None,
    device_flops_per_s: float = DEFAULT_DEVICE_FLOPS_PER_S,
    compute_scale: float = 1.0,
    byte_scale: float = 1.0,
) -> Workload:
    """The emulated model of a profile as a benchmark workload (`benchmarks.testbed.models.build("emulated",
    profile=..., compute_scale=..., byte_scale=...)`)."""
    if byte_scale < 1:
        raise ValueError(
            f"byte_scale must be >= 1 (it divides the tensors' sizes), got {byte_scale}"
        )
    loaded = emulated_profile(profile, batch_size, device_flops_per_s, compute_scale)
    model = EmulatedModel(loaded, byte_scale)
    # The scheduler's smallest row-sparse table, divided by the scale as every size is (the
    # simulator judges a table by its full size, simulator/engine.py `sparse_wire`).
    os.environ.setdefault(sparse_rows.MIN_BYTES_ENV, str(int(sparse_rows.MIN_BYTES // byte_scale)))

    def make_batch(size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(1), torch.zeros(1)

    return Workload("emulated", model, make_batch, _loss, loaded.batch_size)


def describe_scale(
    profile: ModelProfile, byte_scale: float, device_flops_per_s: float, compute_scale: float
) -> str:
    """One line every table from this mode carries."""
    return (
        f"EMULATED arithmetic: {profile.name} ({profile.source}), compute {profile.compute_s * 1e3:.1f} ms "
        f"a step at {device_flops_per_s * compute_scale:.3g} FLOP/s (base {device_flops_per_s:.3g} "
        f"x {compute_scale:g}); bytes / {byte_scale:g} ({profile.total_param_bytes / byte_scale / 2**20:.2f} "
        f"MiB of gradients on the wire of {profile.total_param_bytes / 2**20:.1f}), link rates / {byte_scale:g}"
    )


def layer_sizes(model: EmulatedModel) -> Sequence[tuple[str, list[int]]]:
    """(profile layer name, element counts of its tensors) in forward order."""
    return [
        (layer.profile_name, [p.numel() for p in layer.parameter_list()]) for layer in model.layers
    ]
