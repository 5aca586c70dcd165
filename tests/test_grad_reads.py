"""Gradients a training loop reads between backward() and step() are DDP's (`grad_reads`): the norm
`clip_grad_norm_` returns and clips with, `clip_grad_value_`, a norm logged from `p.grad`, a
parameter no rank used reading None, accumulation under no_sync, `GradScaler.unscale_` before a
clip, assigning `.grad` — each against the same loop on DDP, on every rank, both hot paths. At 2
ranks to the bit; at 4 every rank identical and within DDP's own spread between bucket sizes (a
ring sums each element in an order set by where it falls in the buffer)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.helpers.dist import run_ranks, run_ranks_on

pytestmark = pytest.mark.slow

STEPS = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.head = nn.Linear(64, 8)
        self.unused = nn.Linear(8, 8)  # no rank uses it: its gradient stays None, as DDP's

    def forward(self, x):
        return self.head(self.body(x))


def _loop(rank: int, world: int, mode: str, loop: str) -> dict:
    """`mode`: "ddp", "ddp-small" (DDP with 1 KiB buckets) or "sched"; `loop`: "reads", "amp" or
    "compile" (the reads loop on a torch.compile'd model: dynamo and AOT autograd's backward,
    without inductor's code generation)."""
    import autobyte

    torch.manual_seed(5)
    model = Net()
    base = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if loop == "amp" else None
    if mode.startswith("ddp"):
        wrapped = nn.parallel.DistributedDataParallel(
            model,
            find_unused_parameters=True,
            bucket_cap_mb=(1 / 1024) if mode == "ddp-small" else 25,
        )
        opt, no_sync = base, wrapped.no_sync
    else:
        wrapped = model
        opt = autobyte.ScheduledOptimizer(
            model, base, partition_bytes=4 << 10, credit_bytes=8 << 10, grad_scaler=scaler
        )
        no_sync = opt.no_sync
    if loop == "compile":
        wrapped = torch.compile(wrapped, backend="aot_eager")
    gen = torch.Generator().manual_seed(90 + rank)
    out: dict = {"norm": [], "logged": [], "unused_none": [], "micro_local": []}
    for step in range(STEPS):
        micro = 2 if step % 3 == 2 else 1  # accumulation on some steps
        for k in range(micro):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
            ctx = no_sync() if k < micro - 1 else contextlib.nullcontext()
            with ctx:
                loss = F.mse_loss(wrapped(x), y) / micro
                (scaler.scale(loss) if scaler is not None else loss).backward()
            if k < micro - 1:  # inside no_sync: the local, unreduced gradient, as DDP's
                out["micro_local"].append(model.head.bias.grad.tolist())
        if scaler is not None:
            scaler.unscale_(opt)
        # a norm for logging, from p.grad (before any clip)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        out["logged"].append(
            float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        )
        out["unused_none"].append(model.unused.weight.grad is None)
        out["norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.004)
        if step == 4:  # a loop that edits a gradient: the update uses the edit
            model.head.bias.grad = model.head.bias.grad * 0.5
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    if not mode.startswith("ddp"):
        opt.close()
    # plain values across the process boundary (floats: exact; tensors would need the rank alive)
    out["state"] = {k: v.flatten().tolist() for k, v in model.state_dict().items()}
    out["after_zero_grad"] = model.head.weight.grad is None
    return out


def _max_diff(a: dict, b: dict) -> float:
    worst = max(abs(x - y) for k in a["state"] for x, y in zip(a["state"][k], b["state"][k]))
    for key in ("norm", "logged"):
        worst = max(worst, max(abs(x - y) for x, y in zip(a[key], b[key])))
    return worst


def _same(a: dict, b: dict) -> bool:
    keys = ("state", "norm", "logged", "unused_none", "micro_local", "after_zero_grad")
    return all(a[key] == b[key] for key in keys)


@functools.cache
def _reference(world: int, *args: str, fn=None) -> list:
    """A DDP run of the loop (`fn`, default _loop), once per test process: both hot paths' tests
    compare with it (the same seeds give the same bits every run)."""
    return run_ranks(fn or _loop, world, *args)


@pytest.mark.parametrize("loop", ["reads", "amp"])
@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_gradients_read_between_backward_and_step_are_ddps_to_the_bit_at_2_ranks(hot_path, loop):
    ddp = _reference(2, "ddp", loop)
    sched = run_ranks_on(hot_path, _loop, 2, "sched", loop)
    assert ddp[0]["norm"][0] > 0.05  # the clip clips
    assert all(ddp[0]["unused_none"]) and ddp[0]["after_zero_grad"]
    for rank in (0, 1):
        assert sched[rank]["after_zero_grad"]
        assert _same(sched[rank], ddp[rank]), (
            rank,
            sched[rank]["norm"],
            ddp[rank]["norm"],
            _max_diff(sched[rank], ddp[rank]),
        )


def _clipped(rank: int, world: int, mode: str) -> dict:
    """A loop that clips every step, its first layer's gradient (the last one backward produces)
    16 partitions of 4 KiB behind a credit window of one: the scheduler's collectives per step."""
    import autobyte

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if mode == "ddp":
        wrapped, opt = nn.parallel.DistributedDataParallel(model), base
    else:
        wrapped = model
        opt = autobyte.ScheduledOptimizer(
            model, base, partition_bytes=4 << 10, credit_bytes=4 << 10
        )
    gen = torch.Generator().manual_seed(40 + rank)
    collectives = []
    for _ in range(5):
        x, y = torch.randn(16, 64, generator=gen), torch.randn(16, 8, generator=gen)
        F.mse_loss(wrapped(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        opt.step()
        opt.zero_grad()
        if mode != "ddp":
            opt.synchronize()  # its updates landed: the step's measurements are complete
            collectives.append(opt.last_step_metrics().partitions)
    if mode != "ddp":
        opt.close()
    state = {k: v.flatten().tolist() for k, v in model.state_dict().items()}
    return {"state": state, "collectives": collectives}


@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_a_loop_that_reads_sends_the_rest_of_each_step_as_few_collectives_with_ddps_bits(
    hot_path,
):
    """What is left of a step when a read waits for all of it goes out as one collective per
    contiguous run (Dispatcher.drain): after the first read, the first layer's 16 partitions are
    one all-reduce, not 16 behind the credit window; the parameters stay DDP's to the bit."""
    ddp = _reference(2, "ddp", fn=_clipped)
    sched = run_ranks_on(hot_path, _clipped, 2, "sched")
    partitions = 19  # 18,700 elements (4 flags) of 1,024
    for rank in (0, 1):
        assert sched[rank]["state"] == ddp[rank]["state"], rank
        assert sched[rank]["collectives"] == sched[0]["collectives"]
    # from the second step on the read is known before backward: the tail is one run
    assert all(n <= partitions // 2 for n in sched[0]["collectives"][1:]), sched[0]["collectives"]


def test_gradients_read_after_a_compiled_backward_are_ddps_to_the_bit():
    ddp = run_ranks(_loop, 2, "ddp", "compile")
    sched = run_ranks(_loop, 2, "sched", "compile")
    assert ddp[0]["norm"][0] > 0.05
    for rank in (0, 1):
        assert _same(sched[rank], ddp[rank]), (rank, _max_diff(sched[rank], ddp[rank]))


@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_gradients_read_at_4_ranks_are_identical_on_every_rank_and_within_ddps_spread(hot_path):
    ddp = _reference(4, "ddp", "reads")
    ddp_small = _reference(4, "ddp-small", "reads")
    sched = run_ranks_on(hot_path, _loop, 4, "sched", "reads")
    for rank in range(1, 4):
        assert sched[rank]["state"] == sched[0]["state"], rank
    spread = _max_diff(ddp_small[0], ddp[0])
    assert _max_diff(sched[0], ddp[0]) <= max(spread, 1e-6) * 4, (
        _max_diff(sched[0], ddp[0]),
        spread,
    )
    assert sched[0]["unused_none"] == ddp[0]["unused_none"]


def _inside_backward(rank: int, world: int) -> str:
    """A hook of another parameter reads a gradient the scheduler already took: a clear error."""
    import autobyte

    torch.manual_seed(5)
    model = Net()
    opt = autobyte.ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen = []

    def read_head_grad(_param):
        try:
            seen.append(model.head.weight.grad)
        except Exception as error:  # noqa: BLE001 - the test reports it
            seen.append(error)

    model.body[0].bias.register_post_accumulate_grad_hook(read_head_grad)
    try:
        F.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 8)).backward()
    except Exception as error:  # noqa: BLE001 - the test reports what came out
        return f"{type(error).__name__}: {error}"
    finally:
        with contextlib.suppress(Exception):
            opt.close()
    return repr(seen)


def test_a_read_inside_backward_of_a_gradient_in_flight_raises_naming_it():
    for got in run_ranks(_inside_backward, 2):
        assert "read inside backward()" in got and "head.weight" in got, got
