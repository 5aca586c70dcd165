"""The tail window (Config.tail_bytes): in the last tail_bytes of a backward pass rank 0
issues a collective only while nothing is in flight, on both hot paths; outside it the credit
window holds as before. Its math is DDP's (tests/helpers/equiv.py draws tail windows in every
equivalence, model and habit test; the jitter test in test_scheduler.py reconfigures among them).

Observed from outside the scheduler: every collective's issue and completion on rank 0 (the
native engine's own trace; on the Python path a wrapper around torch.distributed.all_reduce that
stamps the call and the future's completion before the scheduler's own callback), and the times
of the gradient hooks that run after the scheduler's. A collective issued before the step's
second-to-last gradient hook was issued while the last gradient was not yet produced: with the
whole step as the tail, nothing else may be in flight at that moment."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.helpers.dist import run_ranks_on

pytestmark = pytest.mark.multiprocess

STEPS = 12


def _tail_worker(rank: int, world: int, tail_bytes: int | None) -> dict:
    import os

    import torch.distributed as dist
    from autobyte import ScheduledOptimizer

    os.environ["AUTOBYTE_TRACE_PARTITIONS"] = "1"
    calls: list[list[float]] = []  # Python path: [issue, done] per collective

    if os.environ.get("AUTOBYTE_NATIVE") == "0":
        real = dist.all_reduce

        def stamped(tensor, *args, **kwargs):
            t0 = time.perf_counter()
            work = real(tensor, *args, **kwargs)
            if kwargs.get("async_op"):
                record = [t0, float("inf")]
                calls.append(record)
                work.get_future().add_done_callback(
                    lambda _f: record.__setitem__(1, time.perf_counter())
                )
            return work

        dist.all_reduce = stamped

    torch.manual_seed(5)
    model = nn.Sequential(*(nn.Linear(48, 48) for _ in range(6)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # 4 KiB partitions, a 64 KiB window: ~16 collectives could be in flight at once.
    sched = ScheduledOptimizer(
        model, opt, partition_bytes=4 << 10, credit_bytes=64 << 10, tail_bytes=tail_bytes
    )
    hooks: list[float] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: hooks.append(time.perf_counter()))
    windows = []
    gen = torch.Generator().manual_seed(rank)
    with sched:
        for _ in range(STEPS):
            x = torch.randn(8, 48, generator=gen)
            hooks.clear()
            F.mse_loss(model(x), x).backward()
            windows.append((hooks[0], hooks[-2]))  # from the first gradient to the second-to-last
            sched.step()
            sched.zero_grad()
        sched.synchronize()
        if sched.hot_path == "native":
            calls = [
                [t0, done] for *_, t0, _t1, done in sched.engine.dispatcher.engine.take_trace()
            ]
    # For each collective issued inside a backward window: how many others were in flight then.
    overlaps = []
    for start, end in windows[2:]:  # past the first-use recording steps
        for t0, _ in calls:
            if start <= t0 <= end:
                overlaps.append(sum(1 for a, b in calls if a < t0 < b))
    return {"hot_path": sched.hot_path, "overlaps": overlaps, "collectives": len(calls)}


@pytest.mark.alone  # asserts on a measurement another test's load would distort
@pytest.mark.timeout(120)
@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_tail_window_issues_one_collective_at_a_time(hot_path):
    rank0, _ = run_ranks_on(hot_path, _tail_worker, 2, 1 << 30, timeout_s=100)
    assert rank0["hot_path"] == hot_path
    assert rank0["overlaps"], "no collective was issued during a backward pass"
    assert max(rank0["overlaps"]) == 0, rank0["overlaps"]


@pytest.mark.alone  # asserts on a measurement another test's load would distort
@pytest.mark.timeout(120)
@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_without_a_tail_window_the_credit_window_overlaps_collectives(hot_path):
    """The observation above can fail: without a tail window collectives do overlap."""
    rank0, _ = run_ranks_on(hot_path, _tail_worker, 2, None, timeout_s=100)
    assert rank0["hot_path"] == hot_path
    assert max(rank0["overlaps"]) >= 1, rank0["overlaps"]
