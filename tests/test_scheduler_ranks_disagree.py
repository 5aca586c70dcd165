"""Ranks that disagree on the number of steps fail fast: every rank raises within seconds, naming
the step each rank is at and the likely cause, where DDP hangs and the scheduler used to wait out
its 300 s timeout."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.helpers.dist import run_ranks_on

pytestmark = pytest.mark.slow


def _skip_worker(rank: int, world: int, steps: int) -> dict:
    from autobyte import ScheduledOptimizer
    from autobyte.scheduler import SchedulerError

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    outcome: dict = {"steps": 0}
    t_end = None
    try:
        # the default timeout (300 s) stays: detection must not rest on it
        with ScheduledOptimizer(model, opt, partition_bytes=4 << 10, credit_bytes=8 << 10) as sched:
            for step in range(steps):
                x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
                if rank == 1 and step == steps // 2:
                    continue  # the bug in user code: this rank skips one batch
                F.mse_loss(model(x), y).backward()
                sched.step()
                outcome["steps"] += 1
            t_end = time.monotonic()
        outcome["error"] = "not raised"
    except SchedulerError as error:
        outcome["error"] = str(error)
    t_raised = time.monotonic()
    outcome["raised_after_s"] = t_raised - (t_end if t_end is not None else t_raised)
    outcome["hot_path"] = sched.hot_path
    return outcome


@pytest.mark.timeout(150)
@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_a_rank_that_skips_a_step_makes_every_rank_raise_within_seconds(hot_path):
    ranks = run_ranks_on(hot_path, _skip_worker, 2, 10, timeout_s=120)
    assert [got["steps"] for got in ranks] == [10, 9]
    for rank, got in enumerate(ranks):
        assert got["hot_path"] == hot_path
        message = got["error"]
        assert "rank 0 at step 10" in message and "rank 1 at step 9" in message, (rank, message)
        assert "skipped a batch" in message, message
        assert got["raised_after_s"] < 10.0, (rank, got)
