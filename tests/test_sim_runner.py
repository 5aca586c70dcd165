"""The evaluation runner end to end on a short scenario, the checked-in scenarios, profile recording."""

from __future__ import annotations

import csv
import json
import pathlib
import textwrap

import pytest

from benchmarks import evaluate
from benchmarks.scenario import load_scenario

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCENARIOS = sorted((ROOT / "benchmarks" / "scenarios").glob("*.toml"))


def test_checked_in_scenarios_load_and_cover_the_matrix():
    scenarios = [load_scenario(path) for path in SCENARIOS]
    assert {s.profile.name for s in scenarios} >= {"resnet50", "vgg16", "bert-base"}
    workers = {s.workers for s in scenarios}
    assert min(workers) == 2 and max(workers) == 64
    kinds = {__import__("tomllib").loads(path.read_text())["bandwidth"]["kind"] for path in SCENARIOS}
    assert kinds >= {"step", "ramp", "periodic"}


def test_runner_writes_table_csv_json_and_png(tmp_path, capsys):
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(textwrap.dedent("""
        model = "resnet50"
        compute_scale = 50
        workers = 4
        duration_s = 120
        [bandwidth]
        kind = "step"
        levels = [10, 2]
        at_s = [60]
    """))
    out = tmp_path / "out"
    assert evaluate.main([str(scenario), "--policy", "ddp", "static:4MiB,16MiB", "grid-best",
                          "oracle", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "grid-best" in table and "headroom" in table
    rows = list(csv.DictReader(open(out / "results.csv")))
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
    bad.write_text('model = "nope"\nworkers = 2\nduration_s = 1\n[bandwidth]\nkind = "constant"\n'
                   'value = 1\n')
    with pytest.raises(ValueError, match="unknown model"):
        load_scenario(bad)


def test_record_profile_from_a_real_torch_model(tmp_path):
    import torch
    from benchmarks.sim import ModelProfile, record_profile

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    profile = record_profile(model, lambda: batch, torch.nn.functional.cross_entropy,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1), steps=3)
    assert [layer.name for layer in profile.layers] == ["0", "2"]
    assert profile.layers[0].param_bytes == (64 * 128 * 4, 128 * 4)
    assert all(layer.forward_s > 0 and layer.backward_s > 0 for layer in profile.layers)
    assert profile.batch_size == 32
    path = tmp_path / "p.json"
    profile.save(path)
    assert ModelProfile.load(path) == profile
