"""benchmarks/tail_report.py: a tail-window configuration is paired with its twin round by round,
and the block's figures are taken against the probes measured beside them."""

from __future__ import annotations

import pytest

from benchmarks.tail_report import block_report, paired_ratio, per_round, twin


def _result(config: str, round_: int, step_s: float) -> dict:
    return {
        "event": "result",
        "rank": 0,
        "round": round_,
        "config": config,
        "step_times_s": [step_s] * 3,
    }


def test_twin_is_the_same_partition_and_credit_without_the_tail():
    assert twin("sched:1MiB,4MiB,8MiB") == "sched:1MiB,4MiB"
    assert twin("sched:none,16MiB,32MiB") == "sched:none,16MiB"
    assert twin("sched:1MiB,4MiB") is None


def test_pairs_are_taken_per_round_so_drift_cancels():
    # the machine gets 50% slower in round 2; the tail configuration is 10% faster in each round
    results = [
        _result("sched:1MiB,4MiB", 1, 0.30),
        _result("sched:1MiB,4MiB,8MiB", 1, 0.27),
        _result("sched:1MiB,4MiB", 2, 0.45),
        _result("sched:1MiB,4MiB,8MiB", 2, 0.405),
        _result("sched:1MiB,4MiB", 3, 0.30),
    ]
    rounds = per_round(results)
    assert paired_ratio(rounds, "sched:1MiB,4MiB,8MiB", "sched:1MiB,4MiB") == pytest.approx(0.9)
    assert paired_ratio(rounds, "sched:1MiB,4MiB,8MiB", "sched:9MiB,9MiB") is None


def test_block_report_against_ddp_the_bound_and_compute():
    summary = {
        "ddp": {"step_s": 0.5},
        "compute": {"step_s": 0.25},
        "bound": {"step_s": 0.25},
        "sched:1MiB,4MiB": {"step_s": 0.35, "forward_wait_s": 0.05},
        "sched:1MiB,4MiB,8MiB": {"step_s": 0.33, "forward_wait_s": 0.04},
    }
    block = {
        "model": "mlp",
        "rate": "1gbit",
        "load_before": "1.0 1.0 1.0",
        "load_after": "1.5 1.2 1.0",
        "summary": summary,
        "results": [_result("sched:1MiB,4MiB", 1, 0.35), _result("sched:1MiB,4MiB,8MiB", 1, 0.33)],
    }
    report = block_report(block, with_sim=False)
    rows = {r["config"]: r for r in report["rows"]}
    assert rows["sched:1MiB,4MiB,8MiB"]["x_ddp"] == pytest.approx(0.5 / 0.33)
    assert rows["sched:1MiB,4MiB,8MiB"]["step_over_bound"] == pytest.approx(0.33 / 0.25)
    assert rows["sched:1MiB,4MiB,8MiB"]["vs_twin"] == pytest.approx(0.33 / 0.35)
    assert rows["sched:1MiB,4MiB"]["vs_twin"] is None
    assert (report["best"], report["best_without_tail"]) == (
        "sched:1MiB,4MiB,8MiB",
        "sched:1MiB,4MiB",
    )
