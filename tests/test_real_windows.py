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


def test_every_block_measured_the_whole_grid_in_every_round(dataset):
    assert {b["model"] for b in dataset["blocks"]} >= {"mlp", "vgg", "transformer"}
    assert len({b["condition"] for b in dataset["blocks"]}) >= 3
    for block in dataset["blocks"]:
        grid = set(candidate_grid(JobShape(**block["shape"])))
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


def test_a_file_that_is_not_a_dataset_is_refused_by_name(tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"format": "autobyte optimum map v1", "blocks": []}))
    with pytest.raises(ValueError, match="map.json: not a real-windows dataset"):
        rw.load_dataset(path)
