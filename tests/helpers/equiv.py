"""Train a model with DDP and with ScheduledOptimizer in the same (spawned) ranks, and compare.

Used by the scheduler tests on the models and habits real users have: the reference is DDP on the
default group; the scheduled run sees random sleeps in forward/backward hooks and random
reconfigurations on rank 0 (jitter), so any read of a parameter that is not yet updated shows.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from torch import nn

SIZES = [None, 4 << 10, 8 << 10, 64 << 10, 1 << 20]
CREDITS = [None, 4 << 10, 16 << 10, 1 << 20]
# The tail window (autobyte.types.Config.tail_bytes): none, a few partitions, more than any test model (the whole step).
TAILS = [None, None, 8 << 10, 64 << 10, 1 << 30]


def max_state_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest difference between the two models' whole `state_dict()`s: parameters and
    buffers (BatchNorm statistics, counters); inf if their entries differ in name or shape."""
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys() or any(sa[k].shape != sb[k].shape for k in sa):
        return float("inf")
    diffs = [
        (sa[k].detach().to(torch.float64) - sb[k].detach().to(torch.float64)).abs().max().item()
        for k in sa
        if sa[k].numel()
    ]
    return max(diffs, default=0.0)


def unequal_state_entries(a: nn.Module, b: nn.Module) -> list[str]:
    """The `state_dict()` entries (parameters and buffers) that are not equal bit for bit."""
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    return sorted(set(sa) ^ set(sb)) + [k for k in sa if k in sb and not torch.equal(sa[k], sb[k])]


def jitter(model: nn.Module, rng: random.Random, p: float = 0.3, max_s: float = 0.002) -> None:
    """Random sleeps before every module's forward and after every gradient is accumulated."""

    def nap(*_: Any) -> None:
        if rng.random() < p:
            time.sleep(rng.random() * max_s)

    for module in model.modules():
        module.register_forward_pre_hook(nap)
    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(nap)


def train_ddp(
    make_model: Callable[[], nn.Module],
    make_opt: Callable,
    batches: list,
    loss_fn: Callable,
    find_unused: bool = False,
    clip_grad_norm: float | None = None,
) -> tuple[nn.Module, Any]:
    """DDP's run (with `torch.nn.utils.clip_grad_norm_` after each backward if clip_grad_norm)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model()
    ddp = DDP(model, find_unused_parameters=find_unused)
    opt = make_opt(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        opt.step()
    return model, opt


def train_scheduled(
    make_model: Callable[[], nn.Module],
    make_opt: Callable,
    batches: list,
    loss_fn: Callable,
    rank: int,
    seed: int = 0,
    reconfig_p: float = 0.3,
    on_close: Callable[[Any], None] | None = None,
    **kwargs: Any,
) -> tuple[nn.Module, Any, list, str | None]:
    """(model, optimizer, [(step, partition_bytes, credit_bytes, tail_bytes)], the hot path that ran).
    `on_close(scheduler)` runs after the last step's updates, before the scheduler closes."""
    from autobyte import ScheduledOptimizer

    rng = random.Random(seed * 1000 + rank)
    model = make_model()
    opt = make_opt(model.parameters())
    kwargs.setdefault("partition_bytes", 4 << 10)
    kwargs.setdefault("credit_bytes", 4 << 10)
    sched = ScheduledOptimizer(model, opt, **kwargs)
    jitter(model, rng)
    seen: list = []
    sched.add_step_callback(
        lambda m: seen.append(
            (m.step, m.config.partition_bytes, m.config.credit_bytes, m.config.tail_bytes)
        )
    )
    with sched:
        for x, y in batches:
            if rng.random() < reconfig_p:
                sched.reconfigure(
                    rng.choice(SIZES), rng.choice(CREDITS), tail_bytes=rng.choice(TAILS)
                )
            loss_fn(model(x), y).backward()
            sched.step()
            sched.zero_grad()
        if on_close is not None:
            sched.synchronize()
            on_close(sched)
    return model, opt, seen, sched.hot_path


def compare_with_ddp(
    build: Callable[[], nn.Module],
    data: Callable,
    loss_fn: Callable,
    rank: int,
    steps: int,
    model_seed: int,
    data_seed: int,
    run_seed: int,
    ddp_kwargs: dict | None = None,
    **sched_kwargs: Any,
) -> dict:
    """One case of the model-equivalence tests: the same batches (drawn by `data(generator)`, a
    generator per rank) through DDP and through the scheduler (jitter, random reconfigurations),
    both with AdamW from the same initial parameters. The result: the largest parameter
    difference (parameters and buffers), the steps and distinct configurations the scheduler ran, its hot path and its
    `dispatch_stats()` at the end."""
    import torch

    def make_model() -> nn.Module:
        torch.manual_seed(model_seed)
        return build()

    def make_opt(params: Any) -> Any:
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)

    gen = torch.Generator().manual_seed(data_seed + rank)
    batches = [data(gen) for _ in range(steps)]
    ref, _ = train_ddp(make_model, make_opt, batches, loss_fn, **(ddp_kwargs or {}))
    stats: dict = {}
    model, _, seen, hot_path = train_scheduled(
        make_model,
        make_opt,
        batches,
        loss_fn,
        rank,
        seed=run_seed,
        on_close=lambda sched: stats.update(sched.dispatch_stats()),
        **sched_kwargs,
    )
    return {
        "diff": max_state_diff(ref, model),
        "steps": len(seen),
        "hot_path": hot_path,
        "configs": len({tuple(c) for _, *c in seen}),
        "stats": stats,
    }


def ranks_on_path(results: list[dict], hot_path: str) -> list[dict]:
    """The per-rank results of `compare_with_ddp` cases, checked to have run on `hot_path`."""
    for rank in results:
        assert {got["hot_path"] for got in rank.values()} == {hot_path}, rank
    return results


def assert_case_equals_ddp(results: list[dict], name: str, steps: int) -> list[dict]:
    """Every rank ran case `name` for `steps` steps, reconfigured, and ended with DDP's parameters
    bit for bit; returns the case's result per rank."""
    cases = [per_rank[name] for per_rank in results]
    for rank, got in enumerate(cases):
        assert got["steps"] == steps, (rank, got)
        assert got["configs"] > 1, "the run was meant to reconfigure"
        assert got["diff"] == 0.0, (rank, name, got)
    return cases
