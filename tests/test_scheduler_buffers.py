"""Buffers as DDP's (autobyte.scheduler.buffers): BatchNorm running statistics and other buffers
equal DDP's to the bit on every rank, with `broadcast_buffers` True (DDP's default) and False.

Two gloo ranks see different batches, so their BatchNorm statistics drift apart unless rank 0's are
broadcast; each case runs the same phases through DDP and through the scheduler (jitter, random
reconfigurations) and compares every rank's whole `state_dict()` with `torch.equal`. The phases
cover what decides DDP's broadcast: training forwards, an evaluation under `torch.no_grad()` (the
first one receives buffers, the next ones and the first training forward after them do not), eval
mode with gradients, gradient accumulation under `no_sync()`, frozen BatchNorm, a buffer registered
after construction, and a rank whose initial buffers differ.
"""

from __future__ import annotations

import contextlib
import random
import warnings

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_ranks_on
from tests.helpers.equiv import CREDITS, SIZES, jitter, unequal_state_entries


def _build(rank: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        Tally(),
        nn.Linear(64, 16),
        nn.BatchNorm1d(16, momentum=None),
        nn.ReLU(),
        nn.Linear(16, 4),
    )
    if rank == 1:
        with torch.no_grad():  # a rank-local start: DDP's init sync copies it away unless disabled
            model[1].running_mean.add_(1.0)
    return model


class Tally(nn.Module):
    """Once `register`ed (after construction), scales its input by a buffer that every forward
    moves by the input's mean (reassigned, not in place: the product saved it for backward), so
    which forwards receive rank 0's buffer shows in the gradients."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "total"):
            return x
        out = x * (1.0 + 1e-2 * self.total)
        self.total = self.total + x.detach().mean()
        return out

    def register(self) -> None:
        self.register_buffer("total", torch.zeros(()))


# (phase, count): "train" steps, "accumulate" (two micro-batches, the first under no_sync),
# "eval" forwards under torch.no_grad() in eval mode, "eval_grad" training steps in eval mode,
# "late" registers the Tally's buffer.
PHASES = {
    "batchnorm": [
        ("train", 3),
        ("eval", 2),
        ("train", 2),
        ("late", 0),
        ("train", 2),
        ("eval", 2),
        ("train", 1),
        ("accumulate", 1),
        ("train", 1),
        ("eval_grad", 2),
        ("train", 1),
        ("eval", 1),
    ],
    "frozen_batchnorm": [("train", 4), ("eval", 1), ("train", 2)],
    "no_broadcast": [("train", 3), ("eval", 1), ("train", 2)],
}


def _run(rank: int, case: str, scheduled: bool) -> nn.Module:
    from autobyte import ScheduledOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    broadcast = case != "no_broadcast"
    model = _build(rank)
    if case == "frozen_batchnorm":
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    rng = random.Random(rank)
    if scheduled:
        sched = ScheduledOptimizer(model, opt, 4 << 10, 4 << 10, broadcast_buffers=broadcast)
        jitter(model, rng)
        net, stepper = model, sched
        no_sync = sched.no_sync
    else:
        with warnings.catch_warnings():  # torch 2.13 deprecates the name; its meaning is the same
            warnings.simplefilter("ignore", FutureWarning)
            net = DDP(model) if broadcast else DDP(model, broadcast_buffers=False)
        stepper, no_sync = opt, net.no_sync

    def batch():
        return torch.randn(8, 3, 6, 6, generator=gen) * (1 + rank), torch.randint(
            0, 4, (8,), generator=gen
        )

    def frozen_eval():
        if case == "frozen_batchnorm":  # frozen BatchNorm: eval mode while the rest trains
            for module in model.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.eval()

    def train_step(micro: int = 1):
        for k in range(micro):
            x, y = batch()
            with no_sync() if k < micro - 1 else contextlib.nullcontext():
                (nn.functional.cross_entropy(net(x), y) / micro).backward()
        if scheduled and rng.random() < 0.4:
            sched.reconfigure(rng.choice(SIZES), rng.choice(CREDITS))
        stepper.step()
        stepper.zero_grad()

    model.train()
    frozen_eval()
    for phase, count in PHASES[case]:
        if phase == "late":
            model[4].register()
        for _ in range(count):
            if phase == "train":
                model.train()
                frozen_eval()
                train_step()
            elif phase == "accumulate":
                train_step(micro=2)
            elif phase == "eval_grad":
                model.eval()
                train_step()
            else:
                model.eval()
                with torch.no_grad():
                    net(batch()[0])
    if scheduled:
        sched.close()
    return model


def _worker(rank: int, world: int, cases: list[str]) -> dict:
    out = {}
    for case in cases:
        ref = _run(rank, case, scheduled=False)
        got = _run(rank, case, scheduled=True)
        buffers = {name for name, _ in got.named_buffers()}
        unequal = unequal_state_entries(ref, got)
        out[case] = {
            "unequal": unequal,
            "buffers": sorted(buffers),
            "states": {k: v.tolist() for k, v in got.state_dict().items() if k in buffers},
            "bn_modules": sum(
                isinstance(m, nn.modules.batchnorm._BatchNorm) for m in got.modules()
            ),
        }
    return out


@pytest.fixture(scope="module", params=["native", "python"])
def buffer_cases(request):
    """Both hot paths; every case on each."""
    return run_ranks_on(request.param, _worker, 2, list(PHASES), timeout_s=240)


@pytest.mark.parametrize("case", list(PHASES))
def test_state_dict_equals_ddp_on_every_rank(buffer_cases, case):
    for rank, per_rank in enumerate(buffer_cases):
        got = per_rank[case]
        assert got["bn_modules"] == 2
        assert got["unequal"] == [], (rank, case, got["unequal"])


def test_cases_are_ones_where_buffers_matter(buffer_cases):
    """The comparisons could fail: rank 1 starts with its own running mean; training leaves the
    ranks' buffers different from each other (each rank's last training forward updates its own);
    frozen BatchNorm keeps rank 0's, copied at construction; the late buffer exists and moved;
    without the broadcast rank 1 keeps its own running mean."""
    for case in ("batchnorm", "no_broadcast"):
        first, second = (per_rank[case]["states"] for per_rank in buffer_cases)
        assert any(first[k] != second[k] for k in first), case
    first, second = (per_rank["frozen_batchnorm"]["states"] for per_rank in buffer_cases)
    assert first == second
    late = [per_rank["batchnorm"]["states"]["4.total"] for per_rank in buffer_cases]
    assert all(total != 0.0 for total in late)
    rank0, rank1 = (
        torch.tensor(per_rank["no_broadcast"]["states"]["1.running_mean"])
        for per_rank in buffer_cases
    )
    assert (rank1 - rank0).abs().min().item() > 0.5
