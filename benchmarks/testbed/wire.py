"""Sizes and configuration labels of the emulated regime, in the model's bytes and on the scaled
wire: an emulated run divides every tensor, and so every size, by the scenario's byte scale
(benchmarks/testbed/emulated.py); its reports speak in the model's bytes. The worker's labels
(benchmarks/testbed/train_worker.py RunConfig: ddp[:B], sched:P,C[,T], fsdp...) are converted both
ways here, for the emulated benchmark and the evaluation harness alike."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from autobyte.types import Config

from benchmarks.testbed.train_worker import SCHED_KINDS, RunConfig

DDP_DEFAULT_BUCKET = "25MiB"  # torch's bucket_cap_mb default, in the model's bytes


def wire_bytes(model_bytes: int | None, byte_scale: float) -> int | None:
    """A size in the model's bytes on the scaled wire: divided, whole floats, at least 4 KiB."""
    if model_bytes is None:
        return None
    return max(4 << 10, int(model_bytes / byte_scale) // 4 * 4)


CLIP = (
    "+clip"  # a label's loop clips between backward and step (benchmarks/testbed/train_worker.py)
)


def _with_clip(to_label: Any) -> Any:
    """A label function that carries a +clip modifier through unchanged."""

    @functools.wraps(to_label)
    def convert(label: str, byte_scale: float) -> str:
        base, plus, modifier = label.partition("+")
        return to_label(base, byte_scale) + (plus + modifier)

    return convert


@_with_clip
def wire_label(label: str, byte_scale: float) -> str:
    """A configuration label in the model's bytes as the worker runs it on the scaled model."""
    config = RunConfig.parse(label)
    if config.kind == "ddp":
        size = wire_bytes(config.partition_bytes, byte_scale)
        return "ddp" if size is None else f"ddp:{size}"
    if config.kind not in SCHED_KINDS or config.auto:
        return config.label
    sizes = [wire_bytes(b, byte_scale) for b in (config.partition_bytes, config.credit_bytes)]
    if config.tail_bytes is not None:
        sizes.append(wire_bytes(config.tail_bytes, byte_scale))
    return f"{config.kind}:" + ",".join(str(size or "none") for size in sizes)


def model_config(config: Any, byte_scale: float) -> Any:
    """A scheduler configuration the scaled wire ran, in the model's bytes (DDP unchanged)."""
    if byte_scale == 1.0 or not isinstance(config, Config) or config.engine == "fsdp2":
        return config  # FSDP2's knobs are counts, not bytes
    return Config(
        *(None if b is None else round(b * byte_scale) for b in dataclasses.astuple(config))
    )


@_with_clip
def model_label(wire_lab: str, byte_scale: float) -> str:
    """A worker's configuration label (ddp[:B], sched:P,C[,T] on the scaled wire) in the model's
    bytes; DDP's reads "ddp" (its bucket is DDP's default, scaled)."""
    if byte_scale == 1.0:
        return wire_lab
    config = RunConfig.parse(wire_lab)
    if config.kind == "ddp":
        return "ddp"
    sizes = model_config(
        Config(config.partition_bytes, config.credit_bytes, config.tail_bytes), byte_scale
    )
    return RunConfig(config.kind, sizes.partition_bytes, sizes.credit_bytes, sizes.tail_bytes).label


@_with_clip
def wire_run_label(model_lab: str, byte_scale: float) -> str:
    """What the worker runs for a label in the model's bytes: "ddp" is DDP's default bucket
    (25 MiB of the model's bytes), scaled as every size."""
    if byte_scale != 1.0 and model_lab.strip().lower() == "ddp":
        model_lab = f"ddp:{DDP_DEFAULT_BUCKET}"
    return wire_label(model_lab, byte_scale)
