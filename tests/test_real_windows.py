"""The real-window dataset the prior is trained on (simulator/real-windows.json,
recorded on the testbed by benchmarks/record_windows.py): it describes the jobs as a real client
registers them, covers the tuner's whole grid, reads into finite contexts, and carries the share of
the training weight the prior's script says."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from autobyte.types import Config

from autobyted.tuner.features import JobShape
from autobyted.tuner.grid import candidate_grid
from simulator import real_windows as rw


@pytest.fixture(scope="module")
def dataset():
    return rw.load_dataset()


def test_every_block_has_the_shape_a_real_client_registers(dataset):
    """The block's shape is what the client's own fingerprint function gives for the model the worker
    trained (one fingerprint function: no training path computes it differently)."""
    from benchmarks.record_windows import model_shape

    shapes = {}
    for block in dataset["blocks"]:
        key = (
            block["builder"],
            json.dumps(block["model_args"], sort_keys=True),
            block["world_size"],
        )
        if key not in shapes:
            shapes[key] = model_shape(block["builder"], block["model_args"], block["world_size"])
        assert block["shape"] == shapes[key], (block["model"], block["condition"])


def block_grid(block: dict) -> set[Config]:
    """What a block measures in every round: the tuner's whole grid (CPU testbed), or the
    configurations it drew with sched:auto as what the scheduler derived (emulated)."""
    from benchmarks.testbed.train_worker import RunConfig

    if not block.get("emulated"):
        return set(candidate_grid(JobShape(**block["shape"])))
    configs = {Config(*block["default"])}
    for label in block["configs"]:
        parsed = RunConfig.parse(label)
        if not parsed.auto:
            configs.add(Config(parsed.partition_bytes, parsed.credit_bytes, parsed.tail_bytes))
    return configs


def test_every_block_measured_the_whole_grid_in_every_round(dataset):
    assert {b["model"] for b in dataset["blocks"]} >= {"mlp", "vgg", "transformer"}
    assert len({b["condition"] for b in dataset["blocks"]}) >= 3
    for block in dataset["blocks"]:
        grid = block_grid(block)
        rounds = {}
        for item in block["windows"]:
            assert len(item["metrics"]) == block["steps"], (
                block["model"],
                block["condition"],
                item["config"],
            )
            rounds.setdefault(item["round"], set()).add(Config(*item["config"]))
        assert len(rounds) == block["rounds"] and all(
            configs == grid for configs in rounds.values()
        )
        assert block["commit"] and block["load"] and block["load_after"]


def test_windows_read_into_finite_contexts_of_the_measured_configuration(dataset):
    block = dataset["blocks"][0]
    windows = rw.block_windows(block)
    assert len(windows) == len(block["windows"])
    for window, item in zip(windows, block["windows"]):
        assert window.config == Config(*item["config"]) and window.samples == block["steps"]
        assert window.job == rw.block_job(block) and window.segment == item["round"]
        assert all(
            math.isfinite(v)
            for v in (
                window.step_time_s,
                window.context.forward_s,
                window.context.backward_s,
                window.context.bandwidth_bytes_per_s,
            )
        )
        # the sample's own configuration is the window's: what the rank reported it ran
        assert {tuple(m["config"].values()) for m in item["metrics"]} == {tuple(item["config"])}


def test_the_real_windows_carry_the_stated_share_of_the_training_weight(dataset):
    from autobyted.tuner.predictor import training_pairs
    from simulator import train_prior

    simulated = train_prior.generate_windows(contexts=6)
    base = training_pairs(simulated, now_s=0.0, half_life_s=None)
    real = rw.block_windows(dataset["blocks"][0])
    for share in (0.25, 0.5):
        data = train_prior.with_real(base, real, share)
        real_rows = np.array([str(g).startswith("real:") for g in data.groups])
        assert real_rows.sum() == len(data.y) - len(base.y) > 0
        assert data.weights[real_rows].sum() / data.weights.sum() == pytest.approx(share)
    assert train_prior.with_real(base, [], 0.5) is base
    # the emulated-accelerator blocks carry their own share beside the CPU testbed's
    emulated = rw.block_windows(next(b for b in dataset["blocks"] if b.get("emulated")))
    assert all(map(train_prior.is_emulated, emulated)) and not any(
        map(train_prior.is_emulated, real)
    )
    data = train_prior.with_real(base, real + emulated, 0.25, 0.1)
    groups = [str(g) for g in data.groups]
    share = {
        kind: data.weights[[g.startswith(prefix) for g in groups]].sum() / data.weights.sum()
        for kind, prefix in (("emulated", "real:emulated:"), ("real", "real:"))
    }
    assert share["emulated"] == pytest.approx(0.1) and share["real"] == pytest.approx(0.35)
    with pytest.raises(ValueError, match="must leave the simulator a share"):
        train_prior.with_real(base, real + emulated, 0.5, 0.5)


def test_a_file_that_is_not_a_dataset_is_refused_by_name(tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"format": "autobyte optimum map v1", "blocks": []}))
    with pytest.raises(ValueError, match="map.json: not a real-windows dataset"):
        rw.load_dataset(path)


def test_an_emulated_block_is_named_by_scenario_rank_count_and_rate(tmp_path):
    from benchmarks.record_windows import EmulatedBlock

    scenario = "benchmarks/scenarios/emulated-resnet50-8w-1500ms.toml"
    block = EmulatedBlock.parse(f"{scenario}:4:0.5x")
    assert (block.scenario_path, block.ranks, block.rate) == (scenario, 4, "0.5x")
    for bad, message in (
        (f"{scenario}:1:1x", "RANKS >= 2"),
        (f"{scenario}:4:", "SCENARIO.toml:RANKS:RATE"),
        ("nowhere.toml:4:1x", "no scenario file nowhere.toml"),
    ):
        with pytest.raises(ValueError, match=message):
            EmulatedBlock.parse(bad)
    with pytest.raises(ValueError, match="multiple of the balanced rate"):
        EmulatedBlock.parse(f"{scenario}:4:fast").rate_gbit(block.scenario())
    cpu = "benchmarks/scenarios/testbed-mlp-2w-step.toml"
    with pytest.raises(ValueError, match="not an emulated scenario"):
        EmulatedBlock.parse(f"{cpu}:2:1x").scenario()


def test_an_emulated_block_measures_the_derived_start_and_the_grid_the_tuner_searches_there():
    from autobyte.scheduler.start import MIN_AUTO_PARTITION_BYTES

    from autobyted.tuner.grid import TRUST_OCTAVES, _partition_octave
    from benchmarks.record_windows import emulated_labels, estimated_start
    from benchmarks.testbed.train_worker import RunConfig

    shape = {
        "world_size": 4,
        "backend": "gloo",
        "parameter_bytes": 11 << 20,
        "tensor_count": 292,
        "largest_tensor_bytes": 1 << 20,
        "median_tensor_bytes": 64,
    }
    slow, fast = estimated_start(shape, 40e6), estimated_start(shape, 400e6)
    # a faster link sends more bytes in one collective's latency: larger partitions
    assert MIN_AUTO_PARTITION_BYTES <= slow.partition_bytes < fast.partition_bytes
    labels = emulated_labels(shape, 40e6, 6, "seed")
    assert labels == emulated_labels(shape, 40e6, 6, "seed")  # the block's own seed
    assert labels != emulated_labels(shape, 40e6, 6, "another")
    assert labels[0] == "sched:auto" and len(labels) == len(set(labels)) == 7
    configs = [RunConfig.parse(label) for label in labels[1:]]
    assert (configs[0].partition_bytes, configs[0].credit_bytes) == (
        slow.partition_bytes,
        slow.credit_bytes,
    )
    centre = _partition_octave(slow, JobShape(**shape))
    for config in configs:
        candidate = Config(config.partition_bytes, config.credit_bytes)
        assert abs(_partition_octave(candidate, JobShape(**shape)) - centre) <= TRUST_OCTAVES


def test_the_prior_has_simulated_contexts_of_the_emulated_testbed():
    """A quarter of the prior's simulated contexts are of the emulated testbed's kind: a slow device
    at 2, 4 or 8 ranks, a rate around the balanced one, and gloo's per-collective cost as measured
    at that rank count, overlapping the wire time (what benchmarks/sim_vs_emulated.py checks the
    simulator with)."""
    import random

    from simulator import links, train_prior

    rng = random.Random(3)
    emulated = [
        train_prior.emulated_context(rng, train_prior.synthetic_model(rng, i, random.Random(i)))
        for i in range(40)
    ]
    for profile, workers, bandwidth, link in emulated:
        assert workers in (2, 4, 8)
        assert 0.3 <= profile.compute_s <= 4.0 and profile.optimizer_s == 0.0
        balanced = 2 * (workers - 1) / workers * profile.total_param_bytes / profile.compute_s
        assert 0.35 <= bandwidth / balanced <= 3.0
        assert link.fixed_overlaps_wire and link.latency_s == 0.0
        assert link.collective_overhead_s == links.collective_cost_s(workers)
    assert {w for _, w, _, _ in emulated} == {2, 4, 8}
    drawn = random.Random(0)
    links_drawn = [train_prior.draw_context(drawn, i, ())[3] for i in range(200)]
    share = sum(link.fixed_overlaps_wire for link in links_drawn) / len(links_drawn)
    assert 0.15 <= share <= 0.35, share
