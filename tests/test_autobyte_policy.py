"""The `autobyte` policy of benchmarks.harness.evaluate: the daemon's tuner on simulated steps, seeing only
what a rank reports."""

from __future__ import annotations

import dataclasses

from autobyte.types import Config

from simulator.adapter import MetricsAdapter
from simulator.engine import SimulatedStep


def record(**changes) -> SimulatedStep:
    base = SimulatedStep(
        step=7,
        start_s=1.0,
        end_s=1.2,
        step_time_s=0.2,
        compute_s=0.12,
        blocked_s=0.05,
        comm_span_s=0.1,
        bandwidth_bytes_per_s=1.25e9,
        compute_factor=1.0,
        partitions=9,
        bytes_reduced=1 << 25,
        config=Config(4 << 20, 16 << 20),
    )
    return dataclasses.replace(base, **changes)


def test_the_tuner_cannot_see_the_scenarios_true_bandwidth_or_compute_factor():
    seen = MetricsAdapter(0.33, seed=1)(record(), 3)
    hidden = MetricsAdapter(0.33, seed=1)(record(bandwidth_bytes_per_s=1.0, compute_factor=9.0), 3)
    assert seen == hidden
    # what it sees instead: the scheduler's own estimate (bytes / communication span), with noise
    assert 0.7 * (1 << 25) / 0.1 < seen.bandwidth_bytes_per_s < 1.3 * (1 << 25) / 0.1
    assert (seen.decision_id, seen.config, seen.host_load, seen.queueing_delay_s) == (
        3,
        Config(4 << 20, 16 << 20),
        0.0,
        0.0,
    )


def test_the_policy_tunes_a_simulated_job(tmp_path):
    from benchmarks.harness.evaluate import simulate_scenario
    from benchmarks.harness.scenario import load_scenario

    path = tmp_path / "small.toml"
    path.write_text(
        'model = "resnet50"\nworkers = 8\nduration_s = 240\ncompute_scale = 50\n'
        '[bandwidth]\nkind = "step"\nlevels = [25, 3]\nat_s = [120]\n'
        "[link]\nlatency_s = 5e-6\ncollective_overhead_s = 50e-6\nlaunch_s = 50e-6\n"
    )
    keep: dict = {}
    result = simulate_scenario(load_scenario(path), ["autobyte"], keep)
    policy, records = keep["autobyte"]
    assert all(d.reason for d in policy.sink.decisions)
    assert policy.tuner.stats["retunes"] >= 1  # the drop at 120 s was noticed
    details = [s.detail for s in policy.sink.statuses]
    assert any(d.startswith("re-tuning after bandwidth drop") for d in details), details
    # it moved, or (the oracle gains <1% here) the job was told at once that there is no headroom
    moved = {r.config for r in records} > {Config(4 << 20, 16 << 20)}
    assert moved or any(d.startswith("no headroom after bandwidth drop") for d in details), details
    (row,) = result["rows"]
    assert row["ratio_to_oracle"] > 0.9
