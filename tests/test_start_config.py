"""The starting configuration derived from the job (autobyte.scheduler.start): the rule, and the
scheduler built with its defaults on real gloo ranks (every rank the same configuration, the
user's sizes winning, bad sizes refused before anything runs)."""

import math

import pytest
import torch
import torch.distributed as dist
from autobyte.scheduler import start
from autobyte.scheduler.start import CollectiveCost, Requested, derive
from autobyte.types import Config
from torch import nn

from tests.helpers.dist import run_ranks

MiB = 1 << 20


def test_the_partition_balances_the_latencies_against_the_last_partitions_transfer():
    # 1.5 GB of gradients, 2 ms a collective, 100 MB/s, a window of 4 partitions:
    # sqrt(B x latency / (4 x per-byte)) = 8.66 MB
    grad_bytes = 1_500_000_000
    cost = CollectiveCost(2e-3, 1e-8)
    ideal = math.sqrt(grad_bytes * cost.latency_s / (4 * cost.seconds_per_byte))
    config = derive(grad_bytes, cost)
    assert config.partition_bytes == 8 * MiB  # the power of two nearest 8.66 MB (2^23.05)
    assert abs(math.log2(config.partition_bytes) - math.log2(ideal)) <= 0.5
    assert config.credit_bytes == start.CREDIT_PARTITIONS * config.partition_bytes
    # a latency ten times smaller (NCCL-like) or a link ten times faster: smaller / larger partitions
    assert derive(grad_bytes, CollectiveCost(2e-4, 1e-8)).partition_bytes < config.partition_bytes
    assert derive(grad_bytes, CollectiveCost(2e-3, 1e-9)).partition_bytes > config.partition_bytes
    # more gradients, larger partitions (fewer latencies than bytes grow)
    assert derive(grad_bytes // 16, cost).partition_bytes == config.partition_bytes // 4


def test_the_derived_partition_stays_between_its_floor_and_the_gradients():
    assert derive(10 * MiB, CollectiveCost(1.0, 1e-12)).partition_bytes == 8 * MiB  # at most B
    assert derive(10 * MiB, CollectiveCost(1e-9, 1e-6)).partition_bytes == (
        start.MIN_AUTO_PARTITION_BYTES
    )
    # no measurable transfer time: latency is all there is, one partition of all the gradients
    assert derive(3 * MiB, CollectiveCost(1e-4, 0.0)).partition_bytes == 4 * MiB
    assert derive(0, CollectiveCost(1e-4, 1e-9)) == start.FALLBACK


def test_given_sizes_win_and_are_not_measured():
    config, cost = start.resolve(
        2 * MiB, None, world=4, group=None, device=torch.device("cpu"), dtype=torch.float32,
        grad_bytes=100 * MiB,
    )  # fmt: skip
    assert (config, cost) == (Config(2 * MiB, None), None)  # no collective ran: none was set up
    config, cost = start.resolve(
        2 * MiB, "auto", world=4, group=None, device=torch.device("cpu"), dtype=torch.float32,
        grad_bytes=100 * MiB,
    )  # fmt: skip
    assert (config, cost) == (Config(2 * MiB, 8 * MiB), None)
    config, _ = start.resolve(
        None, "auto", world=4, group=None, device=torch.device("cpu"), dtype=torch.float32,
        grad_bytes=100 * MiB,
    )  # fmt: skip
    assert config == Config(None, None)


@pytest.mark.parametrize(
    ("partition", "credit", "named"),
    [("big", "auto", "'big'"), ("auto", "AUTO!", "'AUTO!'"), (1, "auto", "partition_bytes")],
)
def test_a_bad_size_is_refused_by_name(partition, credit, named):
    with pytest.raises(ValueError, match=named):
        Requested(partition, credit)
    assert Requested().describe() == "partition=auto credit=auto"


def _built(rank: int, world: int, sizes: dict) -> dict:
    from autobyte.scheduler import ScheduledOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    opt = ScheduledOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), **sizes)
    try:
        for _ in range(2):
            model(torch.randn(4, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        grad_bytes = sum(p.numel() * 4 for p in model.parameters())
        cost = opt.start_cost
        return {
            "config": opt.config,
            "cost": cost,
            "rule": None if cost is None else derive(grad_bytes, cost),
            "ran": [m.config for m in [opt.last_step_metrics()] if m is not None],
            "world": dist.get_world_size(),
            "latency": opt.collective_latency_s,
        }
    finally:
        opt.close()


def test_the_default_is_derived_on_the_group_and_the_same_on_every_rank():
    ranks = run_ranks(_built, 2, {})
    first = ranks[0]
    assert first["cost"] is not None and first["cost"].latency_s > 0
    assert first["config"] == first["rule"]  # the documented rule, from the measured cost
    assert first["ran"] == [first["config"]]  # the steps ran with it
    # every rank: the same measured cost (the slowest rank's) and the same configuration
    assert [r["cost"] for r in ranks] == [first["cost"]] * 2
    assert [r["config"] for r in ranks] == [first["config"]] * 2
    # the per-collective cost a rank registers with (the predictor's): a small all-reduce's, the
    # slowest rank's on every rank, at least the single element's the rule used
    assert [r["latency"] for r in ranks] == [first["latency"]] * 2
    assert first["latency"] > 0


def test_given_sizes_win_on_the_ranks_and_only_the_latency_is_measured():
    ranks = run_ranks(_built, 2, {"partition_bytes": 64 << 10, "credit_bytes": "auto"})
    for rank in ranks:
        assert rank["config"] == Config(64 << 10, 256 << 10) and rank["cost"] is None
    # the per-collective cost is still measured (small all-reduces, no probe of the link's
    # bytes), the slowest rank's on every rank
    assert ranks[0]["latency"] > 0 and ranks[1]["latency"] == ranks[0]["latency"]
