"""A `torch.compile`d model under the scheduler compiles once (no guard on per-step state; it used
to recompile every step, hit the recompile limit and fall back to eager with the ranks' parameters
apart), with compiled DDP's parameters to the bit and equal on both ranks."""

from __future__ import annotations

import pytest

from tests.helpers.dist import run_ranks_on

pytestmark = pytest.mark.slow


def _compiled_worker(rank: int, world: int, steps: int) -> dict:
    import torch._dynamo
    from autobyte import ScheduledOptimizer
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.test_scheduler_recipes import (
        lm_loss,
        make_lm,
        max_state_diff,
        param_digests,
        token_batches,
    )

    batches = token_batches(rank, steps)
    torch._dynamo.reset()
    model = make_lm()
    compiled_ddp = torch.compile(DDP(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for tokens in batches:
        opt.zero_grad()
        lm_loss(compiled_ddp, tokens).backward()
        opt.step()
    ref = model

    torch._dynamo.reset()
    counters.clear()
    model = make_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled_frames = []
    with ScheduledOptimizer(model, opt, partition_bytes=4 << 10, credit_bytes=8 << 10) as sched:
        compiled = torch.compile(model)
        for tokens in batches:
            lm_loss(compiled, tokens).backward()
            sched.step()
            sched.zero_grad()
            compiled_frames.append(
                (counters["frames"]["total"], counters["stats"]["unique_graphs"])
            )
    return {
        "diff": max_state_diff(ref, model),
        "frames": compiled_frames,
        "digests": param_digests(model),
        "hot_path": sched.hot_path,
    }


@pytest.mark.timeout(280)
def test_a_compiled_model_compiles_once_and_equals_compiled_ddp():
    ranks = run_ranks_on("native", _compiled_worker, 2, 20, timeout_s=260)
    for rank, got in enumerate(ranks):
        frames = got["frames"]
        assert frames[1] == frames[-1], (rank, frames)  # nothing compiled after the first steps
        assert frames[-1][1] >= 1, (rank, frames)  # and it did compile
        assert got["diff"] == 0.0, (rank, got["diff"])
    assert ranks[0]["digests"] == ranks[1]["digests"]
