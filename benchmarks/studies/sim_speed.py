"""Simulator speed benchmark: wall time of 1,000 simulated ResNet-50 steps (target: under 1 s).

    python -m benchmarks.studies.sim_speed [--steps 1000] [--workers 8]

Measures three cases per configuration: a constant bandwidth (the step schedule is cached after the
first step), a bandwidth that changes every 0.5 s (cache hits within each segment, exact
integration across changes), and the uncached cost of one step's communication (the worst case,
what every step would cost without the cache).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from autobyte.types import Config

from simulator import DDP, PiecewiseConstant, Simulator, describe_config, resnet50
from simulator.trace import periodic_trace

GBIT = 1e9 / 8
MIB = 1 << 20


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args(argv)
    profile = resnet50().scaled(50)
    traces = {
        "constant 10G": PiecewiseConstant.constant(10 * GBIT),
        "changes every 0.5s": periodic_trace(25 * GBIT, 5 * GBIT, 1.0, 0.5, 0.25, 1e4),
    }
    print(f"{'config':<16} {'trace':<20} {'messages':>8} {'1000 steps':>11} {'uncached step':>14}")
    for config in (
        DDP,
        Config(4 * MIB, 16 * MIB),
        Config(1 * MIB, 4 * MIB),
        Config(256 << 10, None),
    ):
        for label, trace in traces.items():
            sim = Simulator(profile, args.workers, trace)
            start = time.perf_counter()
            sim.run(config, steps=args.steps)
            elapsed = time.perf_counter() - start
            uncached = Simulator(profile, args.workers, trace)
            start = time.perf_counter()
            for _ in range(20):
                uncached._comm_cache.clear()
                uncached.step(config)
            per_step = (time.perf_counter() - start) / 20
            print(
                f"{describe_config(config):<16} {label:<20} {sim.messages_per_step(config):>8} "
                f"{elapsed * 1000 / args.steps * 1000:>9.1f}ms {per_step * 1e3:>12.2f}ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
