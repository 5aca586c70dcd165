"""The candidate configurations the tuner chooses among (the real scheduler's grid), and how one
is written in its reasons."""

from __future__ import annotations

from autobyte.types import Config

from autobyted.tuner.features import JobShape

KIB, MIB = 1 << 10, 1 << 20
GRID_PARTITIONS = (256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)
GRID_CREDIT_MULTIPLES = (1, 2, 4, 16, None)  # credit = multiple x partition; None = unlimited
GRID_UNPARTITIONED_CREDITS = (4 * MIB, 16 * MIB, 64 * MIB, None)
# The tail window (Config.tail_bytes) where the credit window is deep enough to hold the
# first layers back: credit of 4 and 16 partitions, and the larger unpartitioned credits. The tail
# is twice the credit, so that the window can drain while the last gradients are computed (a
# backward that produces bytes faster than the link sends them needs more than the credit).
# The tuner does not search it (tail_window=False below): on the testbed it measured within noise
# of its twin without one (paired ratios 0.89-1.11, median 1.00 over mlp, vgg and transformer at
# 1 and 10 gbit; docs/scheduler.md, the tail window), while the simulator, which does not model
# the ranks' skew, predicts up to 10% -- trials on that belief would cost and not pay. The prior
# is still trained on it (simulator/train_prior.py), so a job that starts with a tail window is
# predicted like any other.
GRID_TAIL_CREDIT_MULTIPLES = (4, 16)
GRID_TAIL_UNPARTITIONED_CREDITS = (16 * MIB, 64 * MIB)
GRID_TAIL_PER_CREDIT = 2


def candidate_grid(
    shape: JobShape, starting: Config | None = None, tail_window: bool = False
) -> tuple[Config, ...]:
    """Configurations the real scheduler runs, inside autobyte.types' safe limits (Config checks
    them): partitions 256 KiB-64 MiB x credit of 1/2/4/16 partitions or unlimited, unpartitioned
    with 4/16/64 MiB or unlimited credit, with `tail_window` the deeper windows (4 and 16
    partitions, 16 and 64 MiB unpartitioned) also with a tail window of twice the credit, and the
    job's starting configuration. Partitions larger than the whole gradient all send one message: only the
    smallest of them is kept."""
    total = shape.parameter_bytes
    grid: list[Config] = []
    whole_kept = False
    for partition in GRID_PARTITIONS:
        if total and partition >= total:
            if whole_kept:
                continue
            whole_kept = True
        for multiple in GRID_CREDIT_MULTIPLES:
            grid.append(Config(partition, None if multiple is None else partition * multiple))
        for multiple in GRID_TAIL_CREDIT_MULTIPLES if tail_window else ():
            credit = partition * multiple
            grid.append(Config(partition, credit, credit * GRID_TAIL_PER_CREDIT))
    grid += [Config(None, credit) for credit in GRID_UNPARTITIONED_CREDITS]
    if tail_window:
        grid += [
            Config(None, credit, credit * GRID_TAIL_PER_CREDIT)
            for credit in GRID_TAIL_UNPARTITIONED_CREDITS
        ]
    if starting is not None and starting not in grid:
        grid.append(starting)
    return tuple(dict.fromkeys(grid))


def describe(config: Config) -> str:
    return config.short()
