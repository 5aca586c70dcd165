"""benchmarks/phase_report.py: a trace's runs phase by phase, and a poor start's steps to the oracle."""

from __future__ import annotations

import json

import pytest

from benchmarks.phase_report import (
    format_report,
    format_rounds,
    main,
    phase_rates,
    report,
    rounds,
    steps_to_reach,
)

SCENARIO = "benchmarks/scenarios/testbed-resnet-2w-mixed.toml"  # 300 s, a change every 60 s


def _store(cache, key, step_times, labels):
    (cache / f"testbed-resnet-2w-mixed--{key}.json").write_text(
        json.dumps(
            {
                "step_times_s": step_times,
                "labels": labels,
                "decisions": [],
                "applied": 0,
                "tuner": None,
            }
        )
    )


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
    _store(
        tmp_path,
        "policy-autobyte-sched_64KiB_64KiB",
        poor,
        ["sched:64KiB,64KiB"] * 50 + ["sched:1MiB,4MiB"] * 2850,
    )
    _store(tmp_path, "ddp", [0.2] * 1500, ["ddp"] * 1500)
    result = report(SCENARIO, tmp_path)
    rows = {r["run"]: r for r in result["rows"]}
    assert len(result["phases"]) == 5
    assert (
        rows["ddp"]["vs_oracle"] == [pytest.approx(0.5)] * 5
        and "steps_to_oracle" not in rows["ddp"]
    )
    assert rows["policy-autobyte-sched_64KiB_64KiB"]["steps_to_oracle"] == 50 - 10 + 1
    assert rows["policy-autobyte-sched_64KiB_64KiB"]["vs_oracle"][1] == pytest.approx(1.0)
    assert "| policy-oracle | 10.000 | 1.000 |" in format_report(result)


def test_bad_input_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([SCENARIO, str(tmp_path)])
    assert exit_.value.code == 2 and "no cached runs" in capsys.readouterr().err


def test_rounds_compare_within_each_round(tmp_path):
    # round 1 on a fast host, round 2 on one 30% slower: the ratios inside a round are what counts
    first, second = tmp_path / "r1", tmp_path / "r2"
    first.mkdir()
    second.mkdir()
    _store(first, "policy-autobyte", [0.10] * 100, ["sched:4MiB,16MiB"] * 100)
    _store(first, "sched_4MiB_16MiB", [0.11] * 100, ["sched:4MiB,16MiB"] * 100)
    _store(first, "policy-bo-once", [0.09] * 100, ["sched:1MiB,2MiB"] * 100)
    _store(second, "policy-autobyte", [0.13] * 100, ["sched:4MiB,16MiB"] * 100)
    _store(
        second, "sched_4MiB_16MiB", [0.13] * 100, ["sched:4MiB,16MiB"] * 100
    )  # no policy-bo-once this round
    result = rounds(SCENARIO, [first, second])
    assert result["steps_per_s"]["policy-autobyte"] == [
        pytest.approx(10.0),
        pytest.approx(1 / 0.13),
    ]
    default = result["ratios"]["sched_4MiB_16MiB"]
    assert default["per_round"] == [pytest.approx(1.1), pytest.approx(1.0)]
    assert default["median"] == pytest.approx(1.05) and (
        default["at_least"],
        default["rounds"],
    ) == (2, 2)
    bo_once = result["ratios"]["policy-bo-once"]
    assert bo_once["per_round"] == [pytest.approx(0.9), None] and (
        bo_once["at_least"],
        bo_once["rounds"],
    ) == (0, 1)
    assert "| sched_4MiB_16MiB | 1.100 | 1.000 | 1.050 | 2 of 2 |" in format_rounds(result)


def test_rounds_name_a_missing_run(tmp_path, capsys):
    for name in ("r1", "r2"):
        (tmp_path / name).mkdir()
        _store(tmp_path / name, "ddp", [0.2] * 10, ["ddp"] * 10)
    with pytest.raises(SystemExit) as exit_:
        main([SCENARIO, str(tmp_path / "r1"), str(tmp_path / "r2")])
    assert (
        exit_.value.code == 2
        and "--versus 'policy-autobyte': no such run" in capsys.readouterr().err
    )
