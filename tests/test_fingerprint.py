"""One fingerprint: the tensor-size summary a real client registers is the one the prior trains on."""

from __future__ import annotations

import torch
from autobyte.transport.session import model_fingerprint
from autobyte.types import summarize_tensor_sizes
from torch import nn

from autobyted.storage.records import Fingerprint
from autobyted.tuner.features import JobShape
from simulator.adapter import job_shape
from simulator.profiles import LayerProfile, ModelProfile


def _profile_of(model: nn.Module) -> ModelProfile:
    layers = tuple(
        LayerProfile(
            name,
            1e-3,
            2e-3,
            tuple(p.numel() * p.element_size() for p in m.parameters(recurse=False)),
        )
        for name, m in model.named_modules()
        if any(True for _ in m.parameters(recurse=False))
    )
    return ModelProfile("probe", layers)


def test_the_client_and_the_simulator_give_the_predictor_the_same_job_shape():
    # an even number of tensors of different sizes: the median is where the two paths once differed
    model = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32), nn.Linear(32, 8, bias=False)
    )
    registered = model_fingerprint(model.parameters())
    assert registered.tensor_count == 5
    client = JobShape.from_fingerprint(
        2,
        "gloo",
        Fingerprint(
            registered.parameter_count,
            registered.parameter_bytes,
            registered.tensor_count,
            registered.largest_tensor_bytes,
            registered.median_tensor_bytes,
            registered.digest,
        ),
    )
    assert job_shape(_profile_of(model), 2, "gloo") == client
    four = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))  # 4 tensors: 1024, 64, 256, 16 bytes
    assert job_shape(_profile_of(four), 2, "gloo").median_tensor_bytes == (64 + 256) // 2
    assert model_fingerprint(four.parameters()).median_tensor_bytes == (64 + 256) // 2


def test_summary_of_no_tensors_is_zero():
    assert summarize_tensor_sizes([]) == (0, 0, 0, 0)
    assert summarize_tensor_sizes([torch.empty(3).element_size() * 3]).median_tensor_bytes == 12
