"""Windows measured on real processes (the testbed), read from the dataset
`simulator/real-windows.json` that `benchmarks/record_windows.py` records: one block
per (model, condition), every candidate configuration of the tuner's grid in every round, with rank
0's own StepMetrics of every measured step (what its reporter streams and the daemon stores).

`real_windows()` turns the dataset into the predictor's `Window`s: one per (block, round,
configuration); the job is the block (the bootstrap unit of the ensemble) and the segment is the
round, so training pairs are formed only between configurations measured in the same round
(closest in time, same condition).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
from collections.abc import Callable
from typing import Any

from autobyte.types import Config, StepMetrics

from autobyted.tuner.features import JobShape, summarize
from autobyted.tuner.predictor import Window
from simulator.links import lone_collective_s

FORMAT = "autobyte real windows v1"
# beside the code that trains the prior from it (simulator/train_prior.py)
DATASET_PATH = pathlib.Path(__file__).resolve().parent / "real-windows.json"
_FIELDS = {f.name for f in dataclasses.fields(StepMetrics)} - {"config"}


def metrics_from_dict(record: dict[str, Any]) -> StepMetrics:
    config = record.get("config") or {}
    return StepMetrics(
        **{k: v for k, v in record.items() if k in _FIELDS},
        config=Config(
            config.get("partition_bytes"), config.get("credit_bytes"), config.get("tail_bytes")
        ),
    )


def block_job(block: dict[str, Any]) -> str:
    if block.get("emulated"):  # emulated-accelerator blocks: one model at several rank counts
        return (
            f"real:emulated:{block['model']}:{block['world_size']}r:{block['condition']}:"
            f"{block.get('commit', '')}"
        )
    return f"real:{block['model']}:{block['condition']}:{block.get('commit', '')}"


def block_default(block: dict[str, Any]) -> Config | None:
    """The configuration the job started from (the reference the tuner first predicts from): the
    one the scheduler derived in an emulated block; None for the testbed's CPU blocks, which
    started from the constant default (simulator/adapter.py SCHEDULER_DEFAULT)."""
    default = block.get("default")
    return Config(*default) if default else None


def block_shape(block: dict[str, Any]) -> JobShape:
    """The block's registration info. Its per-collective latency, where the block did not record
    one (every block recorded before registrations carried it), is this host's small gloo
    all-reduce at the block's rank count (simulator/links.py `lone_collective_s`): what its
    ranks measured at construction, before any of them computed (on the CPU testbed too)."""
    shape = dict(block["shape"])
    if shape.get("backend") == "gloo":
        shape.setdefault("collective_latency_s", lone_collective_s(int(shape["world_size"])))
    return JobShape(**shape)


def block_windows(block: dict[str, Any]) -> list[Window]:
    shape = block_shape(block)
    job = block_job(block)
    out = []
    for item in block["windows"]:
        samples = [metrics_from_dict(m) for m in item["metrics"]]
        if not samples:
            continue
        step = statistics.median(s.step_time_s for s in samples)
        out.append(
            Window(
                job,
                int(item["round"]),
                Config(*item["config"]),
                summarize(samples, shape),
                step,
                len(samples),
                0.0,
            )
        )
    return out


def load_dataset(path: pathlib.Path = DATASET_PATH) -> dict[str, Any]:
    data = json.loads(pathlib.Path(path).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a real-windows dataset (format {data.get('format')!r})")
    return data


def real_windows(
    path: pathlib.Path = DATASET_PATH, exclude: Callable[[dict[str, Any]], bool] | None = None
) -> list[Window]:
    """Every block's Windows; `exclude(block)` leaves blocks out (a held-out model or condition)."""
    windows: list[Window] = []
    for block in load_dataset(path)["blocks"]:
        if exclude is None or not exclude(block):
            windows += block_windows(block)
    return windows
