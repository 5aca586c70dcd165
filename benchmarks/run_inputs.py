"""What the simulator needs of a measured run's workload (a benchmarks.testbed.models model): its recorded
per-layer profile and the gradient bytes and all-reduces of train_worker's DDP-bucketed probe.
Shared by benchmarks.calibrate and benchmarks.calibrate_map."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from simulator.profiles import ModelProfile, record_profile


def profile_for_run(
    run: dict[str, Any], base: pathlib.Path, cache: dict[str, ModelProfile]
) -> ModelProfile:
    if "profile" in run:
        path = pathlib.Path(run["profile"])
        return ModelProfile.load(path if path.is_absolute() else base / path)
    key = json.dumps(
        [run["model"], run.get("model_args", {}), run.get("batch_size", 0)], sort_keys=True
    )
    if key not in cache:
        import torch

        from benchmarks.testbed.models import build

        torch.manual_seed(0)
        workload = build(run["model"], **run.get("model_args", {}))
        batch_size = int(run.get("batch_size") or workload.default_batch_size)
        batch = workload.make_batch(batch_size, torch.Generator().manual_seed(0))
        optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.01, momentum=0.9)
        cache[key] = record_profile(
            workload.model,
            lambda: batch,
            workload.loss_fn,
            name=run["model"],
            optimizer=optimizer,
            steps=5,
        )
    return cache[key]


def bench_buckets(model: str, model_args: dict[str, Any]) -> tuple[int, int]:
    """(gradient bytes, all-reduces) of train_worker's `comm` probe: DDP-sized 25 MiB buckets."""
    import torch

    from benchmarks.testbed.models import build
    from benchmarks.testbed.train_worker import DDP_BUCKET_BYTES

    torch.manual_seed(0)
    params = list(build(model, **model_args).model.parameters())
    buckets, current = 0, 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and current + nbytes > DDP_BUCKET_BYTES:
            buckets, current = buckets + 1, 0
        current += nbytes
    return sum(p.numel() * p.element_size() for p in params), buckets + 1
