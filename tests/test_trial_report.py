"""benchmarks/trial_report.py: which of a testbed run's trials measured a gain, against the
incumbent measured nearest the search."""

from __future__ import annotations

import pytest

from benchmarks.trial_report import format_report, trials


def run(segments):
    times, labels = [], []
    for label, step_s, count in segments:
        times += [step_s] * count
        labels += [label] * count
    return times, labels


def decision(i, config, at, reason):
    return {
        "decision_id": i,
        "config": config,
        "applied_at_step": at,
        "reason": reason,
        "predicted_step_time_s": 0.09,
    }


def test_a_trial_that_ran_faster_than_the_incumbent_is_a_gain_and_a_slower_one_costs_its_steps():
    times, labels = run(
        [
            ("sched:4MiB,16MiB", 0.100, 30),
            ("sched:4MiB,4MiB", 0.090, 20),
            ("sched:16MiB,16MiB", 0.120, 20),
            ("sched:4MiB,16MiB", 0.100, 30),
        ]
    )
    series = {
        "step_times_s": times,
        "labels": labels,
        "decisions": [
            decision(
                1, "4MiB/4MiB", 30, "trial 1/2: 4MiB/4MiB predicted 1.10x faster than 4MiB/16MiB"
            ),
            decision(
                2,
                "16MiB/16MiB",
                50,
                "trial 2/2: 16MiB/16MiB predicted 1.05x faster than 4MiB/16MiB",
            ),
            decision(3, "4MiB/16MiB", 70, "return to 4MiB/16MiB: no trial beat it"),
        ],
    }
    rows = trials(series)
    assert [(r["config"], r["gain"], r["steps"]) for r in rows] == [
        ("4MiB/4MiB", True, 20),
        ("16MiB/16MiB", False, 20),
    ]
    assert rows[0]["incumbent_step_s"] == pytest.approx(0.100)
    assert rows[1]["cost_s"] == pytest.approx(0.02 * 20)
    text = format_report(rows, len(times))
    assert (
        "2 trials, 1 measured a gain (50%" in text and "20 of 100 steps in trials that lost" in text
    )


def test_the_incumbent_is_the_one_measured_nearest_the_search_not_long_before_or_after():
    """A check re-measures the incumbent during a search; steps of it long before (another context)
    or after (holding) do not count."""
    times, labels = run(
        [
            ("sched:4MiB,16MiB", 0.300, 100),
            ("sched:4MiB,16MiB", 0.100, 20),
            ("sched:4MiB,4MiB", 0.110, 20),
            ("sched:4MiB,16MiB", 0.104, 20),
            ("sched:4MiB,16MiB", 0.050, 200),
        ]
    )
    series = {
        "step_times_s": times,
        "labels": labels,
        "decisions": [
            decision(
                1, "4MiB/4MiB", 120, "trial 1/1: 4MiB/4MiB predicted 1.10x faster than 4MiB/16MiB"
            ),
            decision(
                2,
                "4MiB/16MiB",
                140,
                "check: compute slowdown on rank 0 during trial 1? measuring 4MiB/16MiB again",
            ),
        ],
    }
    (row,) = trials(series)
    assert not row["gain"] and 0.100 <= row["incumbent_step_s"] <= 0.104
