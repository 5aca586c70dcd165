"""benchmarks/replay_tuner.py: the daemon's JobTuner replayed on a block of recorded steps. The block
here is built like a real-windows block (every grid configuration, rank 0's StepMetrics as
dictionaries) from a landscape the test chooses."""

from __future__ import annotations

import dataclasses
import random

import pytest
from autobyte.types import Config

from autobyted.tuner.grid import candidate_grid
from benchmarks.replay_tuner import pooled, replay_block, slope_through_origin, tuner_params
from tests.helpers.tuner import BEST, SHAPE, START, better, predictor_for, sample


def block_from(landscape, steps: int = 10, rounds: int = 2) -> dict:
    rng = random.Random(5)
    windows = []
    for round_ in range(rounds):
        for config in candidate_grid(SHAPE, START):
            step_s, bandwidth = landscape(config, 0)
            metrics = []
            for i in range(steps):
                m = sample(i, config, 0, step_s, bandwidth, rng, noise=0.02)
                record = dataclasses.asdict(m)
                record["config"] = {
                    "partition_bytes": config.partition_bytes,
                    "credit_bytes": config.credit_bytes,
                }
                metrics.append(record)
            windows.append(
                {
                    "round": round_,
                    "config": [config.partition_bytes, config.credit_bytes],
                    "metrics": metrics,
                }
            )
    return {
        "model": "test",
        "condition": "quiet",
        "commit": "t",
        "shape": dataclasses.asdict(SHAPE),
        "windows": windows,
    }


def test_a_replay_finds_the_faster_configuration_and_counts_what_it_cost():
    block = block_from(better(BEST, 0.3))
    summary = replay_block(block, predictor_for(BEST, 0.3), steps=300, seed=0).summary()
    assert summary["final"] == BEST.short() and summary["final_vs_best"] > 0.97
    assert (
        summary["trials"] >= 1 and summary["gains"] >= 1
    )  # BEST beat the default it was tried against
    # the replay's time against the default held: most of the 30% (baseline and trial steps cost)
    assert 1.15 < summary["vs_default"] < 1 / 0.7 and summary["vs_oracle"] > 0.85
    assert abs(summary["default_vs_best"] - 0.7) < 0.03


def test_a_replay_where_nothing_wins_keeps_the_default_and_counts_the_lost_trials():
    def landscape(config, step):  # every other configuration 20% slower than the default
        return (0.1 if config == START else 0.12), 1e8

    summary = replay_block(
        block_from(landscape), predictor_for(BEST, 0.3), steps=300, seed=0
    ).summary()
    assert summary["final"] == START.short() and summary["trials"] >= 1
    assert summary["gains"] == 0 and 0 < summary["steps_in_lost_trials"] < 40 * summary["trials"]
    assert summary["vs_default"] < 1.0 and summary["vs_default"] > 0.95  # the lost trials' cost
    both = pooled([summary, summary])
    assert (
        both["replays"] == 2
        and both["trials"] == 2 * summary["trials"]
        and both["gain_share"] == 0.0
    )


def test_a_block_without_the_default_is_refused_by_name():
    block = block_from(better(BEST, 0.3))
    block["windows"] = [w for w in block["windows"] if Config(*w["config"]) != START]
    with pytest.raises(ValueError, match="no recorded steps of the default 4MiB/16MiB"):
        replay_block(block, predictor_for(BEST, 0.3), steps=50, seed=0)


def test_slope_and_params():
    slope, rms = slope_through_origin([(-0.1, -0.05), (-0.2, -0.1)])
    assert abs(slope - 0.5) < 1e-9 and rms < 1e-9
    assert tuner_params(["max_trials=2", "gain_error_sd=0.1"]).max_trials == 2
    with pytest.raises(ValueError, match="NAME=VALUE"):
        tuner_params(["nonsense=1"])
    with pytest.raises(ValueError, match="is not a int"):
        tuner_params(["max_trials=two"])
