"""benchmarks/phase_report.py: a trace's runs phase by phase, and a poor start's steps to the oracle."""

from __future__ import annotations

import json

import pytest

from benchmarks.phase_report import format_report, main, phase_rates, report, steps_to_reach

SCENARIO = "benchmarks/scenarios/testbed-resnet-2w-mixed.toml"  # 300 s, a change every 60 s


def _store(cache, key, step_times, labels):
    (cache / f"testbed-resnet-2w-mixed--{key}.json").write_text(json.dumps(
        {"step_times_s": step_times, "labels": labels, "decisions": [], "applied": 0, "tuner": None}))


def test_rates_per_phase_count_each_step_where_it_ended():
    assert phase_rates([0.5] * 8, [(0, 2), (2, 4)]) == [2.0, 2.0]
    assert phase_rates([1.0, 2.5], [(0, 2), (2, 4)]) == [1.0, 0.4]


def test_steps_to_reach_waits_for_a_whole_window_within_the_margin():
    times = [0.2] * 100 + [0.102] * 200  # 20 s slow, then 2% above the oracle's 0.1 s
    assert steps_to_reach(times, [(0, 1000)], [0.1], within=0.03, window=20) == 100 - 9
    assert steps_to_reach(times, [(0, 1000)], [0.1], within=0.01, window=20) is None


def test_report_on_cached_runs(tmp_path):
    oracle = [0.1] * 3000  # 300 s
    poor = [0.3] * 50 + [0.1] * 2850  # 15 s in a poor configuration, then as the oracle
    _store(tmp_path, "policy-oracle", oracle, ["sched:1MiB,4MiB"] * len(oracle))
    _store(tmp_path, "policy-autobyte-sched_64KiB_64KiB", poor, ["sched:64KiB,64KiB"] * 50 + ["sched:1MiB,4MiB"] * 2850)
    _store(tmp_path, "ddp", [0.2] * 1500, ["ddp"] * 1500)
    result = report(SCENARIO, tmp_path)
    rows = {r["run"]: r for r in result["rows"]}
    assert len(result["phases"]) == 5
    assert rows["ddp"]["vs_oracle"] == [pytest.approx(0.5)] * 5 and "steps_to_oracle" not in rows["ddp"]
    assert rows["policy-autobyte-sched_64KiB_64KiB"]["steps_to_oracle"] == 50 - 10 + 1
    assert rows["policy-autobyte-sched_64KiB_64KiB"]["vs_oracle"][1] == pytest.approx(1.0)
    assert "| policy-oracle | 10.000 | 1.000 |" in format_report(result)


def test_bad_input_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([SCENARIO, str(tmp_path)])
    assert exit_.value.code == 2 and "no cached runs" in capsys.readouterr().err
