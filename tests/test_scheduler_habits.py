"""The user's own collectives beside the scheduler's, and data-parallel subgroups of a larger job.

The scheduler's all-reduces run from a background thread; anything the training loop does on any
group (logging all_reduce, barrier, all_gather in evaluation, a SyncBatchNorm-style layer, another DDP
model) must never interleave with them. With 4 ranks as 2 data-parallel groups of 2, each group is
scheduled on its own and equals DDP on that group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from tests.helpers.dist import SPARSE_ROWS_EVERYWHERE, run_ranks_on

pytestmark = pytest.mark.slow


class _GlobalMean(torch.autograd.Function):
    """Mean over the ranks of a group, with an all_reduce in forward and in backward (as
    SyncBatchNorm does; nn.SyncBatchNorm itself needs a GPU: see tests/test_scheduler_cuda.py)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y / dist.get_world_size(group)

    @staticmethod
    def backward(ctx, grad):
        g = grad.clone()
        dist.all_reduce(g, group=ctx.group)
        return g / dist.get_world_size(ctx.group), None


class SyncNorm(nn.Module):
    def __init__(self, features: int, group=None) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.ones(features))
        self.bias = nn.Parameter(torch.zeros(features))

    def forward(self, x):
        mean = _GlobalMean.apply(x.mean(0, keepdim=True), self.group)
        var = _GlobalMean.apply((x - mean).square().mean(0, keepdim=True), self.group)
        return (x - mean) / torch.sqrt(var + 1e-5) * self.weight + self.bias


def _net(seed: int, group=None) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 64),
        SyncNorm(64, group),
        nn.Tanh(),
        nn.Linear(64, 64),
        nn.Tanh(),
        nn.Linear(64, 1024),
    )


def _side(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _habits_loop(rank: int, model_a, step_a, model_b, ddp_b, opt_b, batches) -> list[float]:
    """The same loop for the reference and the scheduled run: a second DDP model trained beside,
    the loss all-reduced for logging (1024 elements: the size of a 4 KiB partition), a barrier and an
    all_gather evaluation now and then."""
    logged = []
    for step, (x, y, z) in enumerate(batches):
        out = model_a(x)
        loss = F.mse_loss(out, y)
        loss.backward()
        step_a()
        opt_b.zero_grad()
        F.mse_loss(ddp_b(x), z).backward()
        opt_b.step()
        report = (out.detach() - y).square().mean(0)  # 1024 elements
        dist.all_reduce(report)
        logged.append(report.sum().item())
        if step % 3 == 0:
            dist.barrier()
        if step % 5 == 4:
            with torch.no_grad():
                pred = model_a(x)[:, :4].contiguous()
            gathered = [torch.empty_like(pred) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, pred)
            logged.append(torch.stack(gathered).sum().item())
    return logged


def _habits_worker(rank: int, world: int, steps: int) -> dict:
    from autobyte import ScheduledOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    gen = torch.Generator().manual_seed(40 + rank)
    batches = [
        (
            torch.randn(8, 16, generator=gen),
            torch.randn(8, 1024, generator=gen),
            torch.randn(8, 4, generator=gen),
        )
        for _ in range(steps)
    ]

    hot_paths: list = []

    def run(scheduled: bool):
        model_a = _net(1)
        opt_a = torch.optim.SGD(model_a.parameters(), lr=0.05, momentum=0.9)
        model_b = _side(2)
        ddp_b = DDP(model_b)
        opt_b = torch.optim.Adam(model_b.parameters(), lr=1e-3)
        if scheduled:
            sched = ScheduledOptimizer(
                model_a, opt_a, partition_bytes=4 << 10, credit_bytes=8 << 10, timeout_s=30
            )

            def sched_step():
                sched.step()
                sched.zero_grad()

            with sched:
                logged = _habits_loop(rank, model_a, sched_step, model_b, ddp_b, opt_b, batches)
            hot_paths.append(sched.hot_path)
        else:
            ddp_a = DDP(model_a)

            def step_a():
                opt_a.step()
                opt_a.zero_grad()

            logged = _habits_loop(rank, ddp_a, step_a, model_b, ddp_b, opt_b, batches)
        return model_a, model_b, logged

    ref_a, ref_b, ref_logged = run(False)
    model_a, model_b, logged = run(True)
    diff = lambda m, n: max(
        (p - q).abs().max().item() for p, q in zip(m.parameters(), n.parameters())
    )
    return {
        "a": diff(ref_a, model_a),
        "b": diff(ref_b, model_b),
        "logged": logged == ref_logged,
        "hot_paths": hot_paths,
    }


@pytest.mark.timeout(200)
@pytest.mark.parametrize("hot_path", ["native", "python"])  # the native engine issues from C++
def test_user_collectives_never_interleave_with_the_schedulers(hot_path):
    for rank, got in enumerate(
        run_ranks_on(hot_path, _habits_worker, 2, 40, timeout_s=180, env=SPARSE_ROWS_EVERYWHERE)
    ):
        assert got == {"a": 0.0, "b": 0.0, "logged": True, "hot_paths": [hot_path]}, (rank, got)


def _subgroups_worker(rank: int, world: int, steps: int) -> dict:
    from autobyte import ScheduledOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    # The user's groups: data-parallel {0,1} and {2,3}; "model-parallel" {0,2} and {1,3}.
    dp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    my_dp, my_mp = dp[rank // 2], mp[rank % 2]
    gen = torch.Generator().manual_seed(60 + rank)
    batches = [
        (torch.randn(8, 16, generator=gen), torch.randn(8, 1024, generator=gen))
        for _ in range(steps)
    ]

    def run(scheduled: bool):
        model = _net(10 + rank // 2, my_dp)  # each data-parallel group trains its own replica set
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = (
            ScheduledOptimizer(model, opt, 8 << 10, 8 << 10, process_group=my_dp)
            if scheduled
            else None
        )
        net = model if scheduled else DDP(model, process_group=my_dp)
        for x, y in batches:
            F.mse_loss(net(x), y).backward()
            if scheduled:
                sched.step()
                sched.zero_grad()
            else:
                opt.step()
                opt.zero_grad()
            shared = torch.ones(4) * rank
            dist.all_reduce(shared, group=my_mp)  # traffic on a crossing group every step
        if scheduled:
            sched.close()
            hot_paths.append(sched.hot_path)
        return model

    hot_paths: list = []
    ref, model = run(False), run(True)
    return {
        "diff": max(
            (p - q).abs().max().item() for p, q in zip(ref.parameters(), model.parameters())
        ),
        "first": next(model.parameters()).detach().flatten().tolist(),
        "hot_paths": hot_paths,
    }


@pytest.mark.timeout(200)
def test_data_parallel_subgroups_of_a_larger_job():
    results = run_ranks_on(
        "native", _subgroups_worker, 4, 25, timeout_s=180, env=SPARSE_ROWS_EVERYWHERE
    )
    for rank, got in enumerate(results):
        assert got["diff"] == 0.0, (rank, got["diff"])
        assert got["hot_paths"] == ["native"], (rank, got["hot_paths"])
    # replicas agree within a group, and the two groups trained different replicas
    assert results[0]["first"] == results[1]["first"]
    assert results[2]["first"] == results[3]["first"]
    assert results[0]["first"] != results[2]["first"]
