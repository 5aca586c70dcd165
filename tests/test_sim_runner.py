"""The evaluation runner end to end on a short scenario, the checked-in scenarios, profile recording."""

from __future__ import annotations

import csv
import json
import pathlib
import textwrap

import pytest

from benchmarks.harness import evaluate
from benchmarks.harness.scenario import load_scenario

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCENARIOS = sorted((ROOT / "benchmarks" / "scenarios").glob("*.toml"))


def test_checked_in_scenarios_load_and_cover_the_matrix():
    scenarios = [load_scenario(path) for path in SCENARIOS]
    assert {s.profile.name for s in scenarios} >= {"resnet50", "vgg16", "bert-base"}
    workers = {s.workers for s in scenarios}
    assert min(workers) == 2 and max(workers) == 64
    kinds = {
        __import__("tomllib").loads(path.read_text())["bandwidth"]["kind"] for path in SCENARIOS
    }
    assert kinds >= {"step", "ramp", "periodic"}


def test_runner_writes_table_csv_json_and_png(tmp_path, capsys):
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(
        textwrap.dedent("""
        model = "resnet50"
        compute_scale = 50
        workers = 4
        duration_s = 120
        [bandwidth]
        kind = "step"
        levels = [10, 2]
        at_s = [60]
    """)
    )
    out = tmp_path / "out"
    assert (
        evaluate.main(
            [
                str(scenario),
                "--policy",
                "ddp",
                "static:4MiB,16MiB",
                "grid-best",
                "oracle",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "grid-best" in table and "headroom" in table
    with open(out / "results.csv", newline="") as table_file:
        rows = list(csv.DictReader(table_file))
    assert [r["policy"] for r in rows] == ["ddp", "static:4MiB,16MiB", "grid-best", "oracle"]
    data = json.loads((out / "results.json").read_text())
    result = data["scenarios"][0]
    by_policy = {r["policy"]: r for r in result["rows"]}
    assert by_policy["grid-best"]["ratio_to_grid_best"] == pytest.approx(1.0)
    for row in result["rows"]:
        assert 0 < row["ratio_to_lower_bound"] <= 1.0 + 1e-9
        assert row["ratio_to_grid_best"] <= 1.0 + 1e-9 or row["policy"] == "oracle"
    assert (out / "tiny.png").stat().st_size > 1000


def test_scenario_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('model = "resnet50"\nworkers = 2\n[bandwidth]\nkind = "constant"\nvalue = 1\n')
    with pytest.raises(ValueError, match="duration"):
        load_scenario(bad)
    bad.write_text(
        'model = "nope"\nworkers = 2\nduration_s = 1\n[bandwidth]\nkind = "constant"\nvalue = 1\n'
    )
    with pytest.raises(ValueError, match="unknown model"):
        load_scenario(bad)


def test_record_profile_from_a_real_torch_model(tmp_path):
    import torch

    from simulator import ModelProfile, record_profile

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    profile = record_profile(
        model,
        lambda: batch,
        torch.nn.functional.cross_entropy,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        steps=3,
    )
    assert [layer.name for layer in profile.layers] == ["0", "2"]
    assert profile.layers[0].param_bytes == (64 * 128 * 4, 128 * 4)
    assert all(layer.forward_s > 0 and layer.backward_s > 0 for layer in profile.layers)
    assert profile.batch_size == 32
    path = tmp_path / "p.json"
    profile.save(path)
    assert ModelProfile.load(path) == profile


def _map_block(model_args, condition, spec, times_ms, probes):
    labels = ["ddp", "sched:none,none", "sched:64KiB,128KiB", "sched:1MiB,none"]
    per_round = {label: [t / 1e3, t / 1e3 * 1.01] for label, t in zip(labels, times_ms)}
    return {
        "model": "tiny",
        "builder": "mlp",
        "model_args": model_args,
        "batch_size": 8,
        "condition": condition,
        "condition_spec": spec,
        "world_size": 2,
        "rate": "1gbit",
        "rows": {k: {"median_step_s": sum(v) / 2} for k, v in per_round.items()},
        "per_round": per_round,
        "probes": probes,
    }


def test_map_calibration_reports_rankings_and_writes_scenarios(tmp_path):
    """calibrate --map on a two-block map: per block tau/regret, headroom measured vs predicted,
    and a generated scenario that loads, carries the condition and runs in the simulator."""
    from benchmarks.calibrate import main as calibrate_main

    model_args = {"in_features": 32, "hidden": 64, "depth": 1}
    probes = {
        "compute_s_per_rank": [0.010, 0.010],
        "comm_s": 0.004,
        "collective_s": {"4096": 0.0008, "262144": 0.0025, "2097152": 0.018},
    }
    slow = {**probes, "compute_s_per_rank": [0.010, 0.020]}
    spec_quiet = {"rank_rates": [], "cpu": [], "busy": [], "flows": [], "ranks": 2}
    spec_cpu = {**spec_quiet, "cpu": [[1, 0.5]]}
    data = {
        "chunks": [{"command": "test"}],
        "blocks": [
            _map_block(model_args, "quiet", spec_quiet, [30, 20, 22, 25], probes),
            _map_block(model_args, "cpu1=0.5", spec_cpu, [45, 40, 60, 35], slow),
        ],
    }
    path = tmp_path / "map.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "scenarios"
    out.mkdir()
    report_path = tmp_path / "report.json"
    assert (
        calibrate_main(
            [
                "--map",
                str(path),
                "--profiles",
                str(tmp_path / "profiles"),
                "--out",
                str(report_path),
                "--write-scenarios",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(report_path.read_text())
    assert {row["condition"] for row in report["blocks"]["probes"]} == {"quiet", "cpu1=0.5"}
    for row in report["blocks"]["probes"]:
        assert -1 <= row["tau"] <= 1 and row["regret"] >= 0
    (headroom,) = [h for h in report["headroom"] if h["mode"] == "probes"]
    assert headroom["measured"] == pytest.approx((25 + 35) / (20 + 35) - 1, rel=1e-3)
    assert (tmp_path / "profiles" / "tiny.profile.json").exists()
    (scenario_path,) = out.glob("*.toml")
    # the generated scenario points at ../calibration/profiles: give it one there
    (tmp_path / "calibration" / "profiles").mkdir(parents=True)
    (tmp_path / "calibration" / "profiles" / "tiny.profile.json").write_text(
        (tmp_path / "profiles" / "tiny.profile.json").read_text()
    )
    moved = tmp_path / "scenarios2"
    moved.mkdir()
    target = moved / scenario_path.name
    target.write_text(scenario_path.read_text())
    scenario = load_scenario(target)
    assert scenario.cpu_share is not None and scenario.link.quota_period_s > 0
    assert [p[-1] for p in scenario.phases(scenario.duration_s)] == [1.0, 0.5, 1.0, 0.5]
    sim = scenario.make_simulator()
    from benchmarks.harness.policies import make_policy

    oracle = make_policy("oracle")
    oracle.prepare(evaluate.policy_context(scenario, sim, scenario.duration_s))
    assert len(oracle.phase_configs) == 4
    records = sim.run(oracle.initial_config(), steps=50)
    assert all(r.step_time_s > 0 for r in records)


def test_mixed_trace_switches_conditions_and_rates_at_phase_boundaries():
    """A directly measured mixed trace: the schedule pairs static and per-phase cycles; the trace
    lifts each condition and applies the next at the phase's first step, rates included."""
    from benchmarks.bench_conditions import Condition, mixed_plan, mixed_trace
    from benchmarks.testbed import RateChange, parse_rate

    plan = mixed_plan("sched:4MiB,8MiB", ["sched:1MiB,4MiB", "sched:16MiB,none"], 10, 2)
    assert [(s["at_step"], s["config"]) for s in plan] == [
        (0, "sched:4MiB,8MiB"),
        (10, "sched:4MiB,8MiB"),
        (20, "sched:1MiB,4MiB"),
        (30, "sched:16MiB,none"),
    ]
    conditions = [Condition.parse("rate=10gbit"), Condition.parse("cpu1=0.5+flows1=1")]
    changes = mixed_trace(conditions, 10, 2, "1gbit", offset_steps=0).changes
    rates = [(c.at_step, c.rate_bps, c.ranks) for c in changes if isinstance(c, RateChange)]
    assert rates == [
        (10, parse_rate("1gbit"), None),
        (20, parse_rate("10gbit"), None),
        (30, parse_rate("1gbit"), None),
    ]
    at_10 = [
        (type(c).__name__, getattr(c, "cpu_share", None), c.ranks)
        for c in changes
        if c.at_step == 10
    ]
    assert at_10 == [
        ("RateChange", None, None),
        ("CpuShareChange", 0.5, (1,)),
        ("FlowChange", None, (1,)),
    ]  # every link back to 1gbit first
    lifted = [c for c in changes if c.at_step == 20 and type(c).__name__ == "CpuShareChange"]
    assert [c.cpu_share for c in lifted] == [None]
    with pytest.raises(ValueError, match="rank 3"):
        Condition.parse("cpu3=0.5")


def test_headrooms_only_pair_conditions_one_run_can_switch_between():
    from benchmarks import optimum

    def block(condition, pin, times):
        return {
            "model": "m",
            "world_size": 2,
            "condition": condition,
            "condition_spec": {"pin": pin},
            "rows": {k: {"median_step_s": v} for k, v in times.items()},
            "per_round": {k: [v] for k, v in times.items()},
        }

    blocks = [
        block("quiet", False, {"a": 1.0, "b": 1.2}),
        block("cpu1=0.5", False, {"a": 2.0, "b": 1.5}),
        block("pin=1", True, {"a": 1.0, "b": 1.1}),
    ]
    (item,) = optimum.all_headrooms(blocks)
    assert item["conditions"] == ["quiet", "cpu1=0.5"]
    assert item["headroom"] == pytest.approx(2.7 / 2.5 - 1)


def test_condition_cpu_share_counts_busy_loops_per_rank_and_pinned_cores():
    from benchmarks.bench_conditions import Condition
    from benchmarks.calibrate_map import condition_cpu_share

    def share(text):
        condition = Condition.parse(text)
        return condition_cpu_share(condition.as_dict(), condition.ranks)

    assert share("quiet") == 1.0
    assert share("cpu1=0.5") == 0.5
    assert share("busy1=1") == pytest.approx(2 / 3)  # 2 ranks + 1 loop on 2 cores
    assert share("busy=1") == pytest.approx(2 / 4)  # one loop beside each rank
    assert share("ranks=4") == pytest.approx(2 / 4)
    assert share("pin=1") == 1.0
    assert share("pin=1+busy1=1") == pytest.approx(1 / 2)  # the loop shares rank 1's core
    assert share("ranks=4+pin=1") == pytest.approx(1 / 2)  # two ranks per core
    assert share("cpu=0.3+busy1=1") == pytest.approx(0.3)


def test_one_configuration_for_all_conditions_minimises_the_worst_ratio():
    from benchmarks import optimum

    def block(condition, times):
        return {
            "model": "m",
            "world_size": 2,
            "condition": condition,
            "rows": {k: {"median_step_s": v} for k, v in times.items()},
            "per_round": {k: [v] for k, v in times.items()},
        }

    blocks = [
        block("quiet", {"ddp": 1.3, "a": 1.0, "b": 1.1, "c": 1.05}),
        block("cpu1=0.5", {"ddp": 2.0, "a": 2.4, "b": 2.0, "c": 2.1}),
    ]
    (item,) = optimum.one_for_all(blocks)
    # a: worst 1.2, b: worst 1.1, c: worst 1.05 -> c; ddp: 1.3 / 1.0
    assert item["minimax"] == "c" and item["minimax_worst"] == pytest.approx(1.05)
    assert item["ddp_worst"] == pytest.approx(1.3)
    assert item["ddp_mean"] == pytest.approx((1.3 * 1.0) ** 0.5)
    assert item["worst_config"] == "ddp"
    assert "c" in optimum.format_one_for_all([item])


def test_record_profile_measures_the_rows_an_embedding_batch_touches():
    """An nn.Embedding's weight is recorded as a RowSparseTable with the share of its gradient's
    rows that are non-zero; a weight tied to another module is not a table."""
    import torch

    from simulator import record_profile

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = torch.nn.Embedding(100, 8)
            self.tied = torch.nn.Embedding(50, 8)
            self.out = torch.nn.Linear(8, 50, bias=False)
            self.out.weight = self.tied.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.tokens(x) + self.tied(x % 50)).mean(dim=1)

    batch = (torch.tensor([[1, 2, 3, 4, 5], [5, 6, 7, 8, 9]]), torch.tensor([0, 1]))
    profile = record_profile(Model(), lambda: batch, torch.nn.functional.cross_entropy, steps=2)
    tables = {layer.name: layer.table for layer in profile.layers}
    assert tables["tokens"] is not None and tables["tokens"].rows == 100
    assert tables["tokens"].share == pytest.approx(9 / 100)  # rows 1..9
    assert tables.get("tied") is None and tables.get("out") is None
