"""The one place where protocol messages turn into plain frozen values and back."""

from __future__ import annotations

import dataclasses
import functools

from autobyte.protocol import autobyte_pb2 as pb
from autobyte.types import Config, StepMetrics

# StepMetrics' fields that map one to one onto the message's (every sample goes through here: the
# daemon converts tens of thousands a second, so this is computed once).
_METRIC_FIELDS = tuple(f.name for f in dataclasses.fields(StepMetrics) if f.name != "config")


def config_to_proto(config: Config) -> pb.Config:
    message = pb.Config()
    if config.partition_bytes is not None:
        message.partition_bytes = config.partition_bytes
    if config.credit_bytes is not None:
        message.credit_bytes = config.credit_bytes
    return message


def config_from_proto(message: pb.Config) -> Config:
    """Raises ValueError for values outside the safe limits."""
    return _config(message.partition_bytes if message.HasField("partition_bytes") else None,
                   message.credit_bytes if message.HasField("credit_bytes") else None)


@functools.lru_cache(maxsize=1024)
def _config(partition_bytes: int | None, credit_bytes: int | None) -> Config:
    """Config is frozen: the few configurations a job runs are validated once (a ValueError is not cached)."""
    return Config(partition_bytes=partition_bytes, credit_bytes=credit_bytes)


def metrics_to_proto(metrics: StepMetrics, seq: int) -> pb.StepMetrics:
    fields = {name: getattr(metrics, name) for name in _METRIC_FIELDS}
    return pb.StepMetrics(seq=seq, config=config_to_proto(metrics.config), **fields)


def metrics_from_proto(message: pb.StepMetrics) -> tuple[int, StepMetrics]:
    """(seq, metrics). Raises ValueError on a bad configuration; value checks are the daemon's."""
    fields = {name: getattr(message, name) for name in _METRIC_FIELDS}
    return message.seq, StepMetrics(config=config_from_proto(message.config), **fields)


def config_dict(message: pb.Config) -> dict[str, int | None]:
    """A proto Config as the JSON shape the CLI documents (null = none/unlimited)."""
    return {
        "partition_bytes": message.partition_bytes if message.HasField("partition_bytes") else None,
        "credit_bytes": message.credit_bytes if message.HasField("credit_bytes") else None,
    }
