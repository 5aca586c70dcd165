"""The candidate configurations the tuner chooses among (the real scheduler's grid), and how one
is written in its reasons."""

from __future__ import annotations

import math

from autobyte.types import (
    MAX_CREDIT_BYTES,
    MAX_PARTITION_BYTES,
    MAX_TAIL_BYTES,
    MIN_PARTITION_BYTES,
    Config,
)

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


# The search is local: a candidate's partition (a tensor's mean size where it does not partition)
# lies within TRUST_OCTAVES octaves of the configuration the search starts from, and the grid
# holds that configuration's own ladder (x 1/16, 1/4, 4, 16), so that the search has neighbours at
# any scale of the job (an emulated job whose gradients are bytes / 128 starts at 128 KiB, where
# the absolute grid has nothing below it). Why 4 octaves: the optimum of the derived start
# (client/autobyte/scheduler/start.py: exposed cost a/s + b*s, minimal at s* = sqrt(a/b)) moves
# by the square root of a change of the link's latency-to-rate ratio, so a 16x move needs a 256x
# change; a partition 16x from s* exposes (16 + 1/16) / 2 = 8x the optimum's cost by that model.
# Farther points are out of reach of any change a search answers, and the predictor scores them
# from data of other scales (on the emulated 4-rank GPT-2 job its first trial, 32x the start's
# partition, was predicted 1.65x faster and measured 1.75x slower). A search that wins re-anchors
# there, so successive searches still walk the whole range.
TRUST_OCTAVES = 4
LADDER = (1 / 16, 1 / 4, 4, 16)


def _partition_octave(config: Config, shape: JobShape) -> float:
    mean_tensor = max(1.0, shape.parameter_bytes / max(1, shape.tensor_count))
    return math.log2(config.partition_bytes or mean_tensor)


def candidate_grid(
    shape: JobShape,
    starting: Config | None = None,
    tail_window: bool = False,
    around: Config | None = None,
) -> tuple[Config, ...]:
    """Configurations the real scheduler runs, inside autobyte.types' safe limits (Config checks
    them): partitions 256 KiB-64 MiB x credit of 1/2/4/16 partitions or unlimited, unpartitioned
    with 4/16/64 MiB or unlimited credit, with `tail_window` the deeper windows (4 and 16
    partitions, 16 and 64 MiB unpartitioned) also with a tail window of twice the credit, and the
    job's starting configuration. Partitions larger than the whole gradient all send one message:
    only the smallest of them is kept. A search from `around` (default: `starting`) adds its
    ladder and keeps the candidates within TRUST_OCTAVES of it (the comment above); with neither,
    the whole absolute grid (the prior's training grid)."""
    total = shape.parameter_bytes
    anchor = around if around is not None else starting
    partitions = list(GRID_PARTITIONS)
    if anchor is not None and anchor.partition_bytes is not None:
        partitions += [
            p
            for p in (_power_of_two(anchor.partition_bytes * f) for f in LADDER)
            if MIN_PARTITION_BYTES <= p <= MAX_PARTITION_BYTES
        ]
    grid: list[Config] = []
    whole_kept = False
    for partition in sorted(set(partitions)):
        if total and partition >= total:
            if whole_kept:
                continue
            whole_kept = True
        for multiple in GRID_CREDIT_MULTIPLES:
            credit = None if multiple is None else partition * multiple
            if credit is None or credit <= MAX_CREDIT_BYTES:
                grid.append(Config(partition, credit))
        for multiple in GRID_TAIL_CREDIT_MULTIPLES if tail_window else ():
            credit = partition * multiple
            if credit * GRID_TAIL_PER_CREDIT <= MAX_TAIL_BYTES:
                grid.append(Config(partition, credit, credit * GRID_TAIL_PER_CREDIT))
    grid += [Config(None, credit) for credit in GRID_UNPARTITIONED_CREDITS]
    if tail_window:
        grid += [
            Config(None, credit, credit * GRID_TAIL_PER_CREDIT)
            for credit in GRID_TAIL_UNPARTITIONED_CREDITS
        ]
    if anchor is not None:
        centre = _partition_octave(anchor, shape)
        grid = [c for c in grid if abs(_partition_octave(c, shape) - centre) <= TRUST_OCTAVES]
    for kept in (starting, around):
        if kept is not None and kept not in grid:
            grid.append(kept)
    return tuple(dict.fromkeys(grid))


def _power_of_two(value: float) -> int:
    return 1 << max(0, round(math.log2(value)))


def describe(config: Config) -> str:
    return config.short()
