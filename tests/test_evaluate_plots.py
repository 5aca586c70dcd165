"""Evaluation plots people can read, and --policy given either way."""

from __future__ import annotations

import textwrap

import pytest

from benchmarks.harness import evaluate
from benchmarks.harness.scenario import load_scenario
from tests.helpers.paths import ROOT


def test_rolling_throughput_is_flat_for_evenly_spaced_steps():
    """Steps of 0.3 s: a rolling mean says 3.33 steps/s throughout; whole steps counted in 0.5 s bins
    (what the plots did) alternate between 2 and 4 steps/s."""
    ends = [0.3 * (k + 1) for k in range(100)]
    times, rates = evaluate.rolling_throughput(ends, 5)
    assert times == ends[4:]
    assert rates == pytest.approx([1 / 0.3] * len(rates))
    binned = [sum(1 for e in ends if b * 0.5 <= e < (b + 1) * 0.5) / 0.5 for b in range(50)]
    assert {2.0, 4.0} <= set(binned)  # what a reader saw before: a jumping line
    with pytest.raises(ValueError):
        evaluate.rolling_throughput(ends, 0)


def test_the_plot_shades_phases_and_marks_each_policys_decisions(tmp_path):
    scenario_path = tmp_path / "two-phases.toml"
    scenario_path.write_text(
        textwrap.dedent("""
        model = "resnet50"
        compute_scale = 50
        workers = 4
        duration_s = 120
        [bandwidth]
        kind = "step"
        levels = [10, 2, 10]
        at_s = [40, 80]
    """)
    )
    scenario = load_scenario(scenario_path)
    result = evaluate.simulate_scenario(scenario, ["ddp", "bo-once", "oracle"])
    runs = result["_runs"]
    assert (
        runs["bo-once"].decisions and not runs["ddp"].decisions
    )  # bo-once switches between trials
    fig = evaluate.draw_scenario(result, scenario)
    try:
        top, bottom = fig.axes[:2]
        shaded = [p for p in top.patches if p.get_label() == "_phase"]
        assert (
            len(shaded) == 1 and len([p for p in bottom.patches if p.get_label() == "_phase"]) == 1
        )
        span = shaded[0].get_extents().transformed(top.transData.inverted())  # in data coordinates
        assert (span.x0, span.x1) == pytest.approx(
            (40, 80), abs=0.5
        )  # the middle phase, at 2 Gbit/s
        labels = [line.get_label() for line in top.lines]
        for name in ("ddp", "bo-once", "oracle"):
            marks = [line for line in top.lines if line.get_label().startswith(f"{name}: ")]
            assert len(marks) == (1 if runs[name].decisions else 0), labels
            if marks:
                assert (
                    len(marks[0].get_xdata()) == len(runs[name].decisions)
                    and marks[0].get_marker() == "v"
                )
        assert all(
            any(label.startswith(f"{name} (mean of") for label in labels)
            for name in runs
            if name in ("ddp", "bo-once", "oracle")
        )
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


@pytest.mark.parametrize(
    "argv",
    [
        ["--policy", "ddp", "oracle"],
        ["--policy", "ddp", "--policy", "oracle"],
        ["--policy", "ddp", "--policy", "oracle", "ddp"],
    ],
)
def test_policies_repeated_or_listed(argv):
    assert evaluate.parse_args(["s.toml", *argv]).policy == ["ddp", "oracle"]


def test_default_policies_and_bad_ones():
    assert evaluate.parse_args(["s.toml"]).policy == ["ddp", "grid-best", "bo-once", "oracle"]
    with pytest.raises(SystemExit):
        evaluate.parse_args(["s.toml", "--policy", "ddp", "--policy", "nonsense"])


def test_the_tuner_from_the_derived_start_runs_on_the_testbed_only(capsys):
    """autobyte:auto starts from the sizes each rank derives on its own process group: the
    simulator has none to derive them from, and says so instead of simulating another start."""
    argv = ["s.toml", "--policy", "autobyte:auto"]
    assert evaluate.parse_args([*argv, "--testbed"]).policy == ["autobyte:auto"]
    with pytest.raises(SystemExit):
        evaluate.parse_args(argv)
    assert "runs on the testbed only" in capsys.readouterr().err


def test_the_daemons_database_is_kept_on_request_on_the_testbed_only(tmp_path, capsys):
    argv = ["s.toml", "--keep-daemon", str(tmp_path / "kept")]
    assert evaluate.parse_args([*argv, "--testbed"]).keep_daemon == str(tmp_path / "kept")
    with pytest.raises(SystemExit):
        evaluate.parse_args(argv)
    assert "needs --testbed" in capsys.readouterr().err
    scenario = load_scenario(str(ROOT / "benchmarks" / "scenarios" / "resnet50-2w-step.toml"))
    kept = evaluate._kept(tmp_path / "kept", scenario, "policy-autobyte-sched:auto")
    assert kept == tmp_path / "kept" / f"{scenario.name}--policy-autobyte-sched_auto"
    assert kept.is_dir() and evaluate._kept(None, scenario, "x") is None


def test_the_warm_start_runs_on_the_testbed_only_and_names_a_bad_start(capsys):
    argv = ["s.toml", "--policy", "autobyte-warm:4MiB,16MiB", "autobyte-warm:auto"]
    assert evaluate.parse_args([*argv, "--testbed"]).policy == argv[2:]
    with pytest.raises(SystemExit):
        evaluate.parse_args(argv)
    assert "runs on the testbed only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate.parse_args(["s.toml", "--testbed", "--policy", "autobyte-warm:4MiB"])
    assert "autobyte-warm:4MiB" in capsys.readouterr().err
    assert evaluate._autobyte_label("autobyte-warm:4MiB,16MiB") == "sched:4MiB,16MiB"
    assert evaluate._autobyte_label("autobyte-warm:auto") == "sched:auto"


def test_a_restart_at_another_scale_names_its_first_runs_rank_count(tmp_path, capsys):
    """autobyte-restart:P,C (the job's first run at [testbed] restart_from_workers ranks, its second
    at the scenario's): testbed only, like the warm start; a scenario that does not say the first
    run's rank count, or says its own, is named before any run."""
    argv = ["s.toml", "--policy", "autobyte-restart:4MiB,16MiB", "autobyte-restart:auto"]
    assert evaluate.parse_args([*argv, "--testbed"]).policy == argv[2:]
    with pytest.raises(SystemExit):
        evaluate.parse_args(argv)
    assert "runs on the testbed only" in capsys.readouterr().err
    assert evaluate._autobyte_label("autobyte-restart:4MiB,16MiB") == "sched:4MiB,16MiB"
    checked_in = load_scenario(
        ROOT / "benchmarks" / "scenarios" / "emulated-gpt2-medium-4w-restart.toml"
    )
    assert checked_in.workers == 4 and evaluate.restart_workers(checked_in) == 8
    body = 'model = "gpt2"\nworkers = 4\nduration_s = 10\n[bandwidth]\nkind = "constant"\n'
    for extra, named in (("", "None"), ("restart_from_workers = 4\n", "own rank count")):
        path = tmp_path / f"s{len(extra)}.toml"
        path.write_text(f"{body}value = 10\n[testbed]\n{extra}")
        with pytest.raises(ValueError, match=named):
            evaluate.testbed_scenario(
                load_scenario(path), ["autobyte-restart:4MiB,16MiB"], references=False
            )


def test_steps_to_reach_the_grid_best_are_counted_from_the_configurations_own_steps():
    """The first step of the first stretch whose configuration's own steps in the run (each
    stretch's first two left out) have a median within 3% of the target; a trial that was slower
    does not count, and coming back to a configuration that qualifies dates from its first
    stretch."""
    slow, fast, near = "sched:4MiB,16MiB", "sched:16MiB,64MiB", "sched:64MiB,256MiB"
    labels = [slow] * 10 + [near] * 6 + [slow] * 4 + [fast] * 10
    times = [2.0] * 10 + [1.06] * 6 + [2.0] * 4 + [1.0] * 10
    series = evaluate.TestbedSeries(times, labels)
    assert evaluate.steps_to_reach(series, 1.0) == {"step": 20, "config": fast}
    assert evaluate.steps_to_reach(series, 1.04) == {"step": 10, "config": near}
    assert evaluate.steps_to_reach(series, 0.5) == {"step": None, "config": None}
    # a switch's first two steps are not its configuration's
    settling = evaluate.TestbedSeries([2.0, 2.0, 3.0, 3.0, 1.0, 1.0, 1.0], [slow] * 2 + [fast] * 5)
    assert evaluate.steps_to_reach(settling, 1.0)["step"] == 2


def test_decision_markers_of_the_daemons_decisions_come_from_the_step_they_applied_at():
    """A testbed driver's decisions carry their time; the daemon's (read from its database) carry
    steps: the marker goes at the end of the step before the one it applied at."""
    ends = [0.1, 0.2, 0.3, 0.4]
    assert evaluate._decision_time_s({"t_s": 1.5, "config": "x"}, ends) == 1.5
    assert evaluate._decision_time_s({"applied_at_step": 2, "apply_at_step": 1}, ends) == 0.2
    assert evaluate._decision_time_s({"applied_at_step": None, "apply_at_step": 3}, ends) == 0.3
    assert evaluate._decision_time_s({"applied_at_step": 99}, ends) == 0.4  # past the run: its end
    assert evaluate._decision_time_s({"applied_at_step": None, "apply_at_step": 0}, ends) == 0.0
