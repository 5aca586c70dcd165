"""CUSUM drift detection on synthetic series: real changes alarm quickly, noise and spikes do not.
(The false-alarm *rate* over long stationary runs is measured by `python -m benchmarks.bench_tuner
drift`, not asserted here.)"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from autobyte.types import StepMetrics

from autobyted.tuner.drift import Cusum, DriftDetector, context_jump, window_shift


def series(
    n, rng, step_s=0.1, bandwidth=1e9, compute=0.06, host_load=0.0, noise=0.03, start=0, spikes=0.0
):
    out = []
    for i in range(n):
        spike = rng.uniform(1.5, 3.0) if rng.random() < spikes else 1.0
        out.append(
            StepMetrics(
                step=start + i,
                wall_time_s=1.7e9 + (start + i) * step_s,
                step_time_s=step_s * math.exp(rng.gauss(0, noise)) * spike,
                forward_s=compute / 3 * math.exp(rng.gauss(0, noise)),
                backward_s=2 * compute / 3 * math.exp(rng.gauss(0, noise)),
                bandwidth_bytes_per_s=bandwidth * math.exp(rng.gauss(0, 2 * noise)) / spike,
                bytes_reduced=1 << 24,
                host_load=host_load,
            )
        )
    return out


def alarms(detector, samples):
    found = []
    for index, sample in enumerate(samples):
        alarm = detector.update(sample)
        if alarm:
            found.append((index, alarm))
    return found


@pytest.mark.parametrize("seed", range(3))
def test_stationary_noise_with_spikes_never_alarms(seed):
    rng = random.Random(seed)
    detector = DriftDetector(series(60, rng))
    # 20,000 steps of 0.1 s (~33 minutes) with 3% noise and 2% of steps 1.5-3x slow
    assert alarms(detector, series(20_000, rng, start=60, spikes=0.02)) == []


@pytest.mark.parametrize(
    "change, signal, reason",
    [
        ({"bandwidth": 2.5e8, "step_s": 0.2}, "bandwidth", "bandwidth drop"),
        ({"bandwidth": 3e9}, "bandwidth", "bandwidth rise"),
        ({"compute": 0.09, "step_s": 0.13}, "compute", "compute slowdown"),
        ({"step_s": 0.125}, "step_time", "step time rise"),
    ],
)
def test_a_real_change_alarms_within_a_few_seconds_and_names_its_cause(change, signal, reason):
    rng = random.Random(7)
    detector = DriftDetector(series(60, rng))
    assert alarms(detector, series(300, rng, start=60)) == []
    after = series(300, rng, start=360, **change)
    found = alarms(detector, after)
    assert found, change
    index, alarm = found[0]
    assert (alarm.signal, alarm.reason) == (signal, reason)
    assert index <= 50  # within 5 s of steps of 0.1 s (blocks of half a second)


@pytest.mark.parametrize("head_steps", [10, 0])
def test_a_change_while_the_reference_is_collected_alarms_when_it_completes(head_steps):
    # A configuration held just before a change: the window that measured it is the head start (2
    # blocks of 5 steps), the blocks that complete the reference (8 blocks) are after the change.
    # Against a reference of the new context the CUSUMs would never alarm.
    rng = random.Random(4)
    detector = DriftDetector(series(head_steps, rng))
    before = series(10 if head_steps else 15, rng, start=head_steps)
    assert alarms(detector, before) == []
    start = head_steps + len(before)
    found = alarms(detector, series(300, rng, start=start, bandwidth=1.5e8, step_s=0.3))
    assert found, "a drop while the reference was collected went unseen"
    index, alarm = found[0]
    assert index < 40 - start and detector.ready  # when the 8th block completes
    assert alarm.reason == "bandwidth drop" and alarm.fresh_steps > 0


@pytest.mark.parametrize("seed", range(3))
def test_a_reference_collected_in_one_context_does_not_alarm(seed):
    rng = random.Random(seed)
    for head in (series(10, rng), ()):
        detector = DriftDetector(head)
        assert alarms(detector, series(2_000, rng, start=len(head), spikes=0.02)) == []


def test_host_load_is_watched_only_when_known():
    rng = random.Random(3)
    unknown = DriftDetector(series(60, rng))
    assert "host_load" not in unknown.watched
    known = DriftDetector(series(60, rng, host_load=0.1))
    assert "host_load" in known.watched
    found = alarms(known, series(200, rng, start=60, host_load=0.6))
    assert found and found[0][1].reason == "host load rise"


def test_small_shifts_below_the_relevant_size_do_not_alarm():
    rng = random.Random(11)
    detector = DriftDetector(series(60, rng))
    # 4% slower steps and 10% less bandwidth: below the 10% / 25% that make a re-tune worth it
    assert alarms(detector, series(5_000, rng, start=60, step_s=0.104, bandwidth=0.9e9)) == []


def test_fast_steps_are_judged_per_block_of_time():
    rng = random.Random(5)
    detector = DriftDetector(series(3_500, rng, step_s=0.002))  # > 12 blocks of 0.5 s
    assert detector.ready
    assert (
        alarms(detector, series(50_000, rng, step_s=0.002, start=3_500)) == []
    )  # 100 s of 2 ms steps
    found = alarms(detector, series(5_000, rng, step_s=0.004, start=52_000, bandwidth=4e8))
    assert found and found[0][0] <= 1_500  # 3 s


def test_cusum_arithmetic():
    test = Cusum(mu=0.0, sigma=0.01, min_shift=0.1)
    assert (test.k, test.h) == (0.05, 0.2)
    assert [test.update(0.11) for _ in range(4)] == [0, 0, 0, 1]  # 0.06 per block over h = 0.2
    wild = Cusum(mu=0.0, sigma=0.01, min_shift=0.1)
    assert [wild.update(10.0) for _ in range(4)] == [
        0,
        0,
        0,
        1,
    ]  # wild blocks are clipped at k + h/3


def test_window_comparisons():
    rng = random.Random(2)
    a = series(20, rng)
    assert window_shift(a, series(20, rng)) is None
    shifted = window_shift(a, series(20, rng, bandwidth=3e8))
    assert shifted and shifted.reason == "bandwidth drop"
    # between two configurations the bandwidth estimate may differ 2x without a context change ...
    assert context_jump(a, series(20, rng, bandwidth=2e9)) is None
    # ... but not 6x, and compute time barely moves with the configuration
    assert context_jump(a, series(20, rng, bandwidth=6e9)).reason == "bandwidth rise"
    assert context_jump(a, series(20, rng, compute=0.1)).reason == "compute slowdown"
    assert context_jump(a, [dataclasses.replace(s, bandwidth_bytes_per_s=0.0) for s in a]) is None
