"""The plan past this host: the simulator at rank counts the testbed cannot run, with NCCL-like
per-collective costs, for the scheduler's default, the grid's best and DDP.

    python -m benchmarks.sim_at_scale benchmarks/scenarios/emulated-gpt2-medium-8w.toml \
        --ranks 8,16,32,64 --rates 0.5x,1x,2x

For each scenario (its profile: compute and gradient tensors), rank count N and rate (a multiple
of the balanced rate at N, where a ring all-reduce of all gradients takes the compute, as
`benchmarks.bench_emulated --rates` reads it), the steady step of

- DDP with its default 25 MiB bucket, and with the best bucket of `--ddp-grid`;
- the scheduler's default: the sizes `autobyte.scheduler.start.derive` picks from the costs the
  scheduler would measure on that group (one tiny all-reduce: the link's fixed cost at N plus the
  scheduler's launch; the bytes: the ring's 2(N-1)/N over the rate);
- the scheduler's grid: partitions of `--partitions` with the credit window of the derived start
  (CREDIT_PARTITIONS partitions), its best;
- the bound max(compute, the ring all-reduce of all gradients on the wire), and the dependency
  bound: the scheduler's best on a link with no per-collective cost
  (`simulator.engine.dependency_bound_step_s`, the same credit window). The first layers' gradients are ready last
  in backward and the next forward needs them first, so even a free link leaves their transfer
  exposed (GPT-2's token embedding, tied to its LM head, is 14% of its gradient bytes and ready
  only at the end of backward). The gap from the bound to it is that dependency under the
  scheduler's priority order, not the link's per-collective costs.

The link is the scenario's `[link]` (the shipped emulated scenarios: NCCL-like, 5 us a ring hop,
50 us a collective, 50 us to launch a partition). The simulator is checked against the emulated
testbed at 2, 4 and 8 ranks with this host's gloo costs (`benchmarks.sim_vs_emulated`,
docs/results.md); with NCCL-like costs and past 8 ranks the table is a plan, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from autobyte.scheduler.start import CREDIT_PARTITIONS, CollectiveCost, derive
from autobyte.types import Config, format_bytes, parse_bytes

from benchmarks.bench_emulated import balanced_rate_gbit
from benchmarks.harness.scenario import Scenario, load_scenario
from benchmarks.sim_vs_emulated import write_json
from simulator.engine import (
    DDPConfig,
    LinkModel,
    RunConfig,
    Simulator,
    dependency_bound_step_s,
)
from simulator.trace import PiecewiseConstant

GBIT = 1e9 / 8
DDP_DEFAULT = 25 << 20
DDP_GRID = "5MiB,25MiB,100MiB,400MiB"
PARTITIONS = "1MiB,2MiB,4MiB,8MiB,16MiB,32MiB,64MiB,128MiB,256MiB"
STEADY_STEPS = 8


def parse_sizes(text: str, name: str) -> list[int]:
    try:
        sizes = [parse_bytes(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(f"{name} {text!r}: {error}") from None
    if not sizes or any(size is None or size <= 0 for size in sizes):
        raise ValueError(f"{name} {text!r}: give sizes > 0 such as 4MiB,16MiB")
    return [int(size) for size in sizes if size is not None]


def parse_multiples(text: str) -> list[float]:
    multiples = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            value = float(part.removesuffix("x"))
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(f"--rates {part!r}: give multiples of the balanced rate such as 1x")
        multiples.append(value)
    if not multiples:
        raise ValueError("--rates: give at least one multiple of the balanced rate")
    return multiples


def derived_start(
    grad_bytes: int, ranks: int, link: LinkModel, bandwidth_bytes_per_s: float
) -> Config:
    """What the scheduler derives on this group (autobyte/scheduler/start.py): the latency of a
    tiny all-reduce and the ring's seconds per gradient byte."""
    latency = link.message_s(4.0, ranks) + link.launch_s
    per_byte = 2 * (ranks - 1) / ranks / bandwidth_bytes_per_s
    return derive(grad_bytes, CollectiveCost(latency, per_byte))


def block(
    scenario: Scenario,
    ranks: int,
    multiple: float,
    ddp_grid: Sequence[int],
    partitions: Sequence[int],
) -> dict[str, Any]:
    profile = dataclasses.replace(scenario.profile, optimizer_s=0.0)
    rate_gbit = multiple * balanced_rate_gbit(profile, ranks)
    bandwidth = rate_gbit * GBIT
    link = scenario.link
    sim = Simulator(profile, ranks, PiecewiseConstant.constant(bandwidth), link)

    def step(config: RunConfig) -> float:
        return sim.steady_step_s(config, bandwidth, steps=STEADY_STEPS)

    ddp = {bucket: step(DDPConfig(bucket_bytes=bucket)) for bucket in ddp_grid}
    ddp_default = ddp.get(DDP_DEFAULT) or step(DDPConfig(bucket_bytes=DDP_DEFAULT))
    ddp_best_bucket = min(ddp, key=ddp.__getitem__)
    grid = {p: step(Config(p, p * CREDIT_PARTITIONS)) for p in partitions}
    best_partition = min(grid, key=grid.__getitem__)
    start = derived_start(profile.total_param_bytes, ranks, link, bandwidth)
    default = step(start)
    dependency = dependency_bound_step_s(profile, ranks, bandwidth, CREDIT_PARTITIONS)
    return {
        "profile": profile.name,
        "grad_bytes": profile.total_param_bytes,
        "tensors": profile.num_tensors,
        "ranks": ranks,
        "rate_multiple": multiple,
        "rate_gbit": rate_gbit,
        "fixed_s_per_collective": link.fixed_s(ranks),
        "bound_s": sim.lower_bound_step_s(0.0),
        "dependency_bound_s": dependency,
        "ddp_default_s": ddp_default,
        "ddp_s": {str(bucket): s for bucket, s in ddp.items()},
        "ddp_best_bucket": ddp_best_bucket,
        "ddp_best_s": ddp[ddp_best_bucket],
        "grid_s": {str(p): s for p, s in grid.items()},
        "grid_best_partition": best_partition,
        "grid_best_s": grid[best_partition],
        "default_partition": start.partition_bytes,
        "default_credit": start.credit_bytes,
        "default_s": default,
    }


def format_blocks(blocks: Sequence[dict[str, Any]]) -> str:
    lines = [
        (
            "simulated steady step (ms; x = step / bound); default = the scheduler's derived "
            f"start, grid = partitions with a credit of {CREDIT_PARTITIONS} partitions"
        ),
        (
            f"{'profile':12} {'ranks':>5} {'rate':>5} {'Gbit/s':>7} {'bound':>8} {'dep.':>13} "
            f"{'DDP 25MiB':>15} {'DDP best':>22} {'default':>24} {'grid best':>22} {'def/DDP':>7} "
            f"{'def/grid':>8} {'best/DDPb':>9}"
        ),
    ]
    for b in blocks:

        def ms(value: float, bound: float = b["bound_s"]) -> str:
            return f"{value * 1e3:.1f} ({value / bound:.2f})"

        lines.append(
            f"{b['profile'][:12]:12} {b['ranks']:>5} {b['rate_multiple']:>4g}x "
            f"{b['rate_gbit']:>7.3g} {b['bound_s'] * 1e3:>8.1f} {ms(b['dependency_bound_s']):>13} "
            f"{ms(b['ddp_default_s']):>15} "
            f"{format_bytes(b['ddp_best_bucket']) + ': ' + ms(b['ddp_best_s']):>22} "
            f"{format_bytes(b['default_partition']) + ': ' + ms(b['default_s']):>24} "
            f"{format_bytes(b['grid_best_partition']) + ': ' + ms(b['grid_best_s']):>22} "
            f"{b['ddp_default_s'] / b['default_s']:>7.3f} {b['grid_best_s'] / b['default_s']:>8.3f} "
            f"{b['ddp_best_s'] / b['grid_best_s']:>9.3f}"
        )
    lines.append(
        "dep.: the dependency bound (the scheduler's best on a link with no per-collective cost); "
        "def/DDP: DDP's default over the scheduler's default (>1: the default is faster); "
        "def/grid: the grid's best over the default (1 = the default is the grid's best); "
        "best/DDPb: DDP's best bucket over the grid's best"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="+", help="scenario files (their profile and [link])")
    parser.add_argument("--ranks", default="8,16,32,64")
    parser.add_argument("--rates", default="0.5x,1x,2x", help="multiples of the balanced rate")
    parser.add_argument("--ddp-grid", default=DDP_GRID, help="DDP bucket caps (model bytes)")
    parser.add_argument("--partitions", default=PARTITIONS, help="the scheduler grid's partitions")
    parser.add_argument("--out", default="", help="write the blocks as JSON here")
    args = parser.parse_args(argv)
    try:
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
        if not ranks or min(ranks) < 2:
            raise ValueError(f"--ranks {args.ranks!r}: give rank counts of at least 2")
        multiples = parse_multiples(args.rates)
        ddp_grid = parse_sizes(args.ddp_grid, "--ddp-grid")
        partitions = parse_sizes(args.partitions, "--partitions")
        scenarios = [load_scenario(path) for path in args.scenarios]
        blocks = [
            block(scenario, n, m, ddp_grid, partitions)
            for scenario in scenarios
            for n in ranks
            for m in multiples
        ]
    except (OSError, ValueError, KeyError) as error:
        raise SystemExit(f"sim_at_scale: {error}") from None
    print(format_blocks(blocks))
    write_json(args.out, blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
