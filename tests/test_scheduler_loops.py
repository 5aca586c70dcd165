"""Training loops DDP users write: mixed precision (bf16 autocast; fp16 with GradScaler, including an
overflow step), freezing and unfreezing, two optimizers, reading parameters after step() without
synchronising (state_dict, an EMA, evaluation without a forward pass). All against DDP, bit for bit,
on 2 gloo ranks."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.helpers.dist import run_ranks, run_ranks_on

pytestmark = pytest.mark.slow

STEPS = 30


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.mid = nn.Linear(64, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.body(x))))


def _net() -> Net:
    torch.manual_seed(5)
    return Net()


def _batches(rank: int, steps: int = STEPS) -> list:
    gen = torch.Generator().manual_seed(90 + rank)
    return [
        (torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(steps)
    ]


def _diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _state_diff(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> float:
    worst = 0.0
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for key in sa:
        for name, value in sa[key].items():
            if torch.is_tensor(value):
                worst = max(worst, (value.float() - sb[key][name].float()).abs().max().item())
    return worst


# ---------------------------------------------------------------- mixed precision


def _amp_worker(rank: int, world: int) -> dict:
    from autobyte import ScheduledOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = _batches(rank)
    out = {}

    def run(dtype, scaled: bool, scheduled: bool, overflow_at: int = 7):
        model = _net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        scaler = (
            torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=4) if scaled else None
        )
        if scheduled:
            sched = ScheduledOptimizer(model, opt, 4 << 10, 8 << 10, grad_scaler=scaler)
            net = model
        else:
            net = DDP(model)
        scales = []
        for step, (x, y) in enumerate(batches):
            opt.zero_grad()  # the wrapped optimizer's own, as the DDP loop calls it
            with torch.autocast("cpu", dtype=dtype):
                loss = F.mse_loss(net(x).float(), y)
            if step == overflow_at and rank == 0:
                loss = loss * 1e30  # an overflow on one rank: every rank must skip this step
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(sched if scheduled else opt)
                scaler.update()
                scales.append(scaler.get_scale())
            else:
                loss.backward()
                (sched if scheduled else opt).step()
        skipped = sched.skipped_steps if scheduled else None
        if scheduled:
            sched.close()
        return model, opt, scales, skipped

    for name, dtype, scaled in (
        ("bf16", torch.bfloat16, False),
        ("fp16_scaler", torch.float16, True),
    ):
        ref, ref_opt, ref_scales, _ = run(dtype, scaled, False)
        model, opt, scales, skipped = run(dtype, scaled, True)
        out[name] = {
            "params": _diff(ref, model),
            "state": _state_diff(ref_opt, opt),
            "scales": scales == ref_scales,
            "skipped": skipped,
            "backoffs": sum(b < a for a, b in itertools.pairwise(ref_scales)),
        }
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("hot_path", ["native", "python"])  # whole-step updates on both paths
def test_mixed_precision_equals_ddp(hot_path):
    for rank, got in enumerate(run_ranks_on(hot_path, _amp_worker, 2, timeout_s=180)):
        assert got["bf16"]["params"] == 0.0 and got["bf16"]["state"] == 0.0, (rank, got)
        fp16 = got["fp16_scaler"]
        assert fp16["params"] == 0.0 and fp16["state"] == 0.0, (rank, fp16)
        assert fp16["scales"], "the loss scale must follow GradScaler's after every step"
        assert fp16["skipped"] >= 1 and fp16["backoffs"] >= 1, fp16  # the injected overflow


def _amp_misuse_worker(rank: int, world: int) -> dict:
    from autobyte import ScheduledOptimizer
    from autobyte.scheduler import SchedulerError

    out = {}
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    sched = ScheduledOptimizer(model, opt)  # the scaler not passed: scaler.step must say what to do
    x, y = _batches(rank, 1)[0]
    scaler.scale(F.mse_loss(model(x), y)).backward()
    try:
        scaler.step(sched)
        out["unpassed"] = "accepted"
    except SchedulerError as error:
        out["unpassed"] = str(error)
    sched.step()
    sched.close()
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = ScheduledOptimizer(model, opt, grad_scaler=scaler)
    scaler.scale(F.mse_loss(model(x), y)).backward()
    scaler.unscale_(sched)  # accepted: the reduced gradients (test_grad_reads.py); twice is not
    try:
        scaler.unscale_(sched)
        out["unscale"] = "accepted"
    except RuntimeError as error:
        out["unscale"] = str(error)
    sched.step()
    F.mse_loss(model(x), y).backward()  # forgot scaler.scale(loss)
    try:
        sched.step()
        out["unscaled_loss"] = "accepted"
    except SchedulerError as error:
        out["unscaled_loss"] = str(error)
    sched.close()
    out["restored"] = "scale" not in scaler.__dict__
    return out


@pytest.mark.timeout(120)
def test_mixed_precision_misuse_is_refused_with_directions():
    got = run_ranks(_amp_misuse_worker, 1, timeout_s=100)[0]
    assert "grad_scaler=" in got["unpassed"]
    assert "already been called" in got["unscale"]  # as GradScaler says it
    assert "scaler.scale(loss)" in got["unscaled_loss"]
    assert got["restored"]


# ---------------------------------------------------------------- freezing, two optimizers


def _freeze_worker(rank: int, world: int) -> dict:
    from autobyte import ScheduledOptimizer
    from autobyte.scheduler import SchedulerError
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = _batches(rank)
    out = {}

    # 1. Frozen later: as DDP with find_unused_parameters=True (keeps value and optimizer state).
    def freeze_later(scheduled: bool):
        model = _net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        net = model if scheduled else DDP(model, find_unused_parameters=True)
        sched = ScheduledOptimizer(model, opt, 4 << 10, None) if scheduled else None
        for step, (x, y) in enumerate(batches):
            if step == 10:
                model.mid.requires_grad_(False)
            opt.zero_grad()
            F.mse_loss(net(x), y).backward()
            (sched or opt).step()
        if sched:
            sched.close()
        return model, opt

    (ref, ref_opt), (model, opt) = freeze_later(False), freeze_later(True)
    out["freeze_later"] = (_diff(ref, model), _state_diff(ref_opt, opt))

    # 2. Frozen at construction, unfrozen later: refused at that step, with what to do ...
    model = _net()
    model.mid.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = ScheduledOptimizer(model, opt)
    try:
        for step, (x, y) in enumerate(batches):
            if step == 5:
                model.mid.requires_grad_(True)
            F.mse_loss(model(x), y).backward()
            sched.step()
        out["unfreeze_error"] = "not raised"
    except SchedulerError as error:
        out["unfreeze_error"] = (step, str(error))
    sched.close()

    # ... and equal to DDP re-wrapped when the ScheduledOptimizer is rebuilt (progressive unfreezing).
    def unfreeze(scheduled: bool):
        model = _net()
        model.mid.requires_grad_(False)
        model.head.requires_grad_(False)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        wrap = (
            (lambda: ScheduledOptimizer(model, opt, 8 << 10, 8 << 10))
            if scheduled
            else (lambda: DDP(model))
        )
        wrapped = wrap()
        for step, (x, y) in enumerate(batches):
            if step in (8, 16):
                (model.mid if step == 8 else model.head).requires_grad_(True)
                if scheduled:
                    wrapped.close()
                wrapped = wrap()
            opt.zero_grad()
            F.mse_loss(model(x) if scheduled else wrapped(x), y).backward()
            (wrapped if scheduled else opt).step()
        if scheduled:
            wrapped.close()
        return model, opt

    (ref, ref_opt), (model, opt) = unfreeze(False), unfreeze(True)
    out["unfreeze_rebuilt"] = (_diff(ref, model), _state_diff(ref_opt, opt))

    # 3. Two optimizers: passed as a list, or the second one stepped by the user (its parameters get
    # their averaged gradient in .grad when backward() returns, as with DDP), before or after ours.
    def two(mode: str):
        model = _net()
        body = [*model.body.parameters(), *model.mid.parameters()]
        sgd = torch.optim.SGD(body, lr=0.05, momentum=0.9)
        adam = torch.optim.Adam(model.head.parameters(), lr=1e-3)
        if mode == "ddp":
            net, sched = DDP(model), None
        else:
            net = model
            sched = ScheduledOptimizer(
                model, [sgd, adam] if mode == "list" else sgd, 4 << 10, 8 << 10
            )
        for x, y in batches:
            sgd.zero_grad()
            adam.zero_grad()
            F.mse_loss(net(x), y).backward()
            if mode in ("ddp", "outside_before"):
                adam.step()
            (sched or sgd).step()
            if mode == "outside_after":
                adam.step()
        if sched:
            sched.close()
            out.setdefault("hot_paths", []).append(sched.hot_path)
        return model, (sgd, adam)

    ref, (ref_sgd, ref_adam) = two("ddp")
    for mode in ("list", "outside_before", "outside_after"):
        model, (sgd, adam) = two(mode)
        out[mode] = (_diff(ref, model), _state_diff(ref_sgd, sgd), _state_diff(ref_adam, adam))
    return out


@pytest.mark.timeout(240)
def test_freezing_and_two_optimizers_equal_ddp():
    for rank, got in enumerate(run_ranks_on("native", _freeze_worker, 2, timeout_s=220)):
        assert got["freeze_later"] == (0.0, 0.0), (rank, got)
        step, message = got["unfreeze_error"]
        assert step == 5 and "'mid.weight'" in message and "ScheduledOptimizer(model" in message
        assert got["unfreeze_rebuilt"] == (0.0, 0.0), (rank, got)
        for mode in ("list", "outside_before", "outside_after"):
            assert got[mode] == (0.0, 0.0, 0.0), (rank, mode, got[mode])
        assert got["hot_paths"] == ["native"] * 3, (rank, got["hot_paths"])


# ---------------------------------------------------------------- reading parameters after step()


def _reads_worker(rank: int, world: int) -> dict:
    from autobyte import ScheduledOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = _batches(rank)

    def run(scheduled: bool):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = ScheduledOptimizer(model, opt, 4 << 10, 4 << 10) if scheduled else None
        net = model if scheduled else DDP(model)
        ema = copy.deepcopy(model)  # a plain copy, whatever the scheduler did to the model
        norms = []
        for x, y in batches:
            opt.zero_grad()
            F.mse_loss(net(x), y).backward()
            (sched or opt).step()
            # read right after step(), no synchronize(): an EMA over model.parameters() ...
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.mul_(0.9).add_(p, alpha=0.1)
            norms.append(model.head.weight.norm().item())  # ... and a read without a forward
        saved = {k: v.clone() for k, v in model.state_dict().items()}  # the loop ends: save
        result = (saved, ema, norms, type(ema.head._parameters) is dict)
        if sched:
            sched.close()
        return result

    ref_saved, ref_ema, ref_norms, _ = run(False)
    saved, ema, norms, plain = run(True)
    return {
        "state_dict": max((ref_saved[k] - saved[k]).abs().max().item() for k in saved),
        "ema": _diff(ref_ema, ema),
        "norms": norms == ref_norms,
        "plain_copy": plain,
    }


@pytest.mark.timeout(120)
def test_reading_parameters_after_step_without_synchronize():
    for rank, got in enumerate(run_ranks(_reads_worker, 2, timeout_s=100)):
        assert got == {"state_dict": 0.0, "ema": 0.0, "norms": True, "plain_copy": True}, (
            rank,
            got,
        )


def _untracked_worker(rank: int, world: int) -> str:
    from autobyte import ScheduledOptimizer
    from autobyte.scheduler import SchedulerError

    class Hidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.refs = [self.lin.weight]  # a reference kept outside the module system

        def forward(self, x):
            return F.linear(x, self.refs[0])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Hidden())
    sched = ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(2, 4)).sum().backward()
    try:
        sched.step()
        return "not raised"
    except SchedulerError as error:
        return str(error.__cause__)
    finally:
        sched.close()


@pytest.mark.timeout(60)
def test_untracked_parameter_reads_are_refused():
    message = run_ranks(_untracked_worker, 1, timeout_s=50)[0]
    assert "'1.lin.weight'" in message and "never read through its module" in message


def _direct_step_worker(rank: int, world: int) -> dict:
    from autobyte import ScheduledOptimizer
    from autobyte.scheduler import SchedulerError

    model = _net()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = ScheduledOptimizer(model, base)
    F.mse_loss(model(torch.randn(4, 16)), torch.zeros(4, 8)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    out = {}
    try:
        base.step()  # the wrapped optimizer, not the scheduler
        out["raised"] = "not raised"
    except SchedulerError as error:
        out["raised"] = str(error)
    out["untouched"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    sched.step()  # the loop goes on as it should have
    sched.zero_grad()
    F.mse_loss(model(torch.randn(4, 16)), torch.zeros(4, 8)).backward()
    sched.step()
    sched.close()
    model.zero_grad()
    F.mse_loss(model(torch.randn(4, 16)), torch.zeros(4, 8)).backward()
    base.step()  # closed: the optimizer is the loop's again
    out["after_close"] = True
    return out


@pytest.mark.timeout(60)
def test_stepping_the_wrapped_optimizer_directly_is_refused_where_it_is_made():
    """Before this check the call went through (an update the scheduler did not know of) and the
    next backward raised "received a second gradient in step 0", naming accumulation."""
    for got in run_ranks(_direct_step_worker, 2, timeout_s=50):
        assert (
            "SGD.step() was called on an optimizer that a ScheduledOptimizer wraps"
            in (got["raised"])
        ), got
        assert got["untouched"] and got["after_close"], got
