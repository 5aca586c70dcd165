"""Plain frozen values shared by the scheduler, the client transport, the daemon and the CLI."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable
from typing import NamedTuple

# Safe limits for the two tuned numbers. A partition smaller than 4 KiB costs more in per-collective
# overhead than it can ever win; nothing above 16 GiB is a sane bound for one message or a window.
MIN_PARTITION_BYTES = 4 << 10
MAX_PARTITION_BYTES = 16 << 30
MIN_CREDIT_BYTES = 4 << 10
MAX_CREDIT_BYTES = 16 << 30
# The largest data-parallel group the daemon accepts (it keeps one row per rank of a job).
MAX_WORLD_SIZE = 65_536


def _check_bytes(name: str, value: object, low: int, high: int) -> int | None:
    if value is None:
        return None
    # bool is an int subclass; True bytes is never what a caller meant.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int number of bytes or None, got {value!r}")
    if value < low or value > high:
        raise ValueError(f"{name}={value} is outside the safe range [{low}, {high}] bytes "
                         f"(use None for {'no partitioning' if 'partition' in name else 'unlimited credit'})")
    return value


@dataclasses.dataclass(frozen=True)
class Config:
    """A scheduler configuration. None means no partitioning / unlimited credit."""

    partition_bytes: int | None = None
    credit_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_bytes("partition_bytes", self.partition_bytes, MIN_PARTITION_BYTES, MAX_PARTITION_BYTES)
        _check_bytes("credit_bytes", self.credit_bytes, MIN_CREDIT_BYTES, MAX_CREDIT_BYTES)

    def to_dict(self) -> dict[str, int | None]:
        return {"partition_bytes": self.partition_bytes, "credit_bytes": self.credit_bytes}

    def describe(self) -> str:
        return f"partition={format_bytes(self.partition_bytes, 'none')} credit={format_bytes(self.credit_bytes, 'unlimited')}"


# The one integer encoding of a configuration (rank 0's order-channel frames, the native engine's
# calls and events; native/engine.cpp reads any negative value as None in its is_unlimited()):
# NO_LIMIT_BYTES stands for None, i.e. no partitioning / unlimited credit.
NO_LIMIT_BYTES = -1


def config_to_ints(config: Config) -> tuple[int, int]:
    """(partition_bytes, credit_bytes) with None as NO_LIMIT_BYTES."""
    return (NO_LIMIT_BYTES if config.partition_bytes is None else int(config.partition_bytes),
            NO_LIMIT_BYTES if config.credit_bytes is None else int(config.credit_bytes))


def config_from_ints(partition_bytes: int, credit_bytes: int) -> Config:
    """The inverse of config_to_ints (any negative value reads as None)."""
    return Config(None if partition_bytes < 0 else partition_bytes, None if credit_bytes < 0 else credit_bytes)


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """What one rank measured in one optimizer step (DESIGN §3). Times in seconds. forward_s and
    backward_s are compute: the waits for parameters inside them are exposed_comm_s, not counted."""

    step: int
    wall_time_s: float
    step_time_s: float
    forward_s: float = 0.0
    backward_s: float = 0.0
    exposed_comm_s: float = 0.0
    queueing_delay_s: float = 0.0
    bytes_reduced: int = 0
    partitions: int = 0
    bandwidth_bytes_per_s: float = 0.0
    config: Config = Config()
    decision_id: int = 0
    # Share of the host's CPU capacity used by other processes over the last second, in [0, 1]
    # (autobyte.hostload); 0.0 = unknown.
    host_load: float = 0.0


_DAY_S = 86_400.0
# Upper bounds no real measurement reaches; a value beyond them is a bug, not a measurement.
METRIC_LIMITS = {"step_time_s": _DAY_S, "forward_s": _DAY_S, "backward_s": _DAY_S, "exposed_comm_s": _DAY_S,
                 "queueing_delay_s": _DAY_S, "bytes_reduced": 1 << 50, "partitions": 100_000_000,
                 "bandwidth_bytes_per_s": 1e13, "step": 1 << 53, "decision_id": 1 << 62,
                 "host_load": 1e3}


def check_metrics(metrics: StepMetrics, now_s: float) -> None:
    """ValueError naming the first implausible value (NaN, negative, absurd). The client drops such a
    sample before sending it; the daemon refuses a batch that holds one."""
    for name, limit in METRIC_LIMITS.items():
        value = getattr(metrics, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name}={value} is not a finite number")
        if value < 0 or value > limit:
            raise ValueError(f"{name}={value} is outside [0, {limit:g}]")
    if not (math.isfinite(metrics.wall_time_s) and 0 <= metrics.wall_time_s <= now_s + _DAY_S):
        raise ValueError(f"wall_time_s={metrics.wall_time_s} is not a plausible unix time")


def format_bytes(value: int | None, none: str = "-") -> str:
    """1048576 -> '1MiB'; None -> `none`."""
    if value is None:
        return none
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= 1 << shift and value % (1 << shift) == 0:
            return f"{value >> shift}{unit}"
    if value >= 1 << 20:
        return f"{value / (1 << 20):.1f}MiB"
    return f"{value}B"


def parse_bytes(text: str) -> int | None:
    """'4MiB', '4m', '4096', 'none', 'unlimited' -> bytes (None for none/unlimited)."""
    raw = text.strip().lower()
    if raw in ("none", "unlimited", "inf", "null"):
        return None
    units = {"kib": 1 << 10, "k": 1 << 10, "kb": 1 << 10, "mib": 1 << 20, "m": 1 << 20, "mb": 1 << 20,
             "gib": 1 << 30, "g": 1 << 30, "gb": 1 << 30, "b": 1}
    for suffix in sorted(units, key=len, reverse=True):
        if raw.endswith(suffix):
            number = raw[: -len(suffix)]
            scale = units[suffix]
            break
    else:
        number, scale = raw, 1
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a byte size: {text!r} (examples: 4096, 256KiB, 4MiB, none)") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"not a positive byte size: {text!r}")
    return int(value * scale)


class TensorSizes(NamedTuple):
    """The size summary of a model's parameters that a registration carries and the predictor sees."""

    parameter_bytes: int
    tensor_count: int
    largest_tensor_bytes: int
    median_tensor_bytes: int


def summarize_tensor_sizes(tensor_bytes: Iterable[int]) -> TensorSizes:
    """The one definition of a model's tensor-size summary: the client's registration
    (`autobyte.transport.session.model_fingerprint`) and every path that trains the predictor
    (the simulator's jobs, recorded windows) compute it here, so the prior learns from the features
    a real client sends. The median of an even count is the mean of the two middle sizes."""
    sizes = list(tensor_bytes)
    return TensorSizes(parameter_bytes=sum(sizes), tensor_count=len(sizes),
                       largest_tensor_bytes=max(sizes, default=0),
                       median_tensor_bytes=int(statistics.median(sizes)) if sizes else 0)
