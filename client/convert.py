"""The one place where protocol messages turn into plain frozen values and back."""

from __future__ import annotations

import dataclasses

from autobyte.protocol import autobyte_pb2 as pb
from autobyte.types import Config, StepMetrics


def config_to_proto(config: Config) -> pb.Config:
    message = pb.Config()
    if config.partition_bytes is not None:
        message.partition_bytes = config.partition_bytes
    if config.credit_bytes is not None:
        message.credit_bytes = config.credit_bytes
    return message


def config_from_proto(message: pb.Config) -> Config:
    """Raises ValueError for values outside the safe limits."""
    return Config(
        partition_bytes=message.partition_bytes if message.HasField("partition_bytes") else None,
        credit_bytes=message.credit_bytes if message.HasField("credit_bytes") else None,
    )


def metrics_to_proto(metrics: StepMetrics, seq: int) -> pb.StepMetrics:
    fields = {f.name: getattr(metrics, f.name) for f in dataclasses.fields(StepMetrics) if f.name != "config"}
    return pb.StepMetrics(seq=seq, config=config_to_proto(metrics.config), **fields)


def metrics_from_proto(message: pb.StepMetrics) -> tuple[int, StepMetrics]:
    """(seq, metrics). Raises ValueError on a bad configuration; value checks are the daemon's."""
    fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(StepMetrics) if f.name != "config"}
    return message.seq, StepMetrics(config=config_from_proto(message.config), **fields)


def config_dict(message: pb.Config) -> dict[str, int | None]:
    """A proto Config as the JSON shape the CLI documents (null = none/unlimited)."""
    return {
        "partition_bytes": message.partition_bytes if message.HasField("partition_bytes") else None,
        "credit_bytes": message.credit_bytes if message.HasField("credit_bytes") else None,
    }
