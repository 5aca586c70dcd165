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
MIN_TAIL_BYTES = 4 << 10
MAX_TAIL_BYTES = 16 << 30
# The largest data-parallel group the daemon accepts (it keeps one row per rank of a job).
MAX_WORLD_SIZE = 65_536


def _check_bytes(name: str, value: object, low: int, high: int) -> int | None:
    if value is None:
        return None
    # bool is an int subclass; True bytes is never what a caller meant.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int number of bytes or None, got {value!r}")
    if value < low or value > high:
        raise ValueError(
            f"{name}={value} is outside the safe range [{low}, {high}] bytes "
            f"(use None for {_NONE_MEANS[name]})"
        )
    return value


_NONE_MEANS = {
    "partition_bytes": "no partitioning",
    "credit_bytes": "unlimited credit",
    "tail_bytes": "no tail window",
}


# FSDP2's knobs (autobyte.fsdp): the deepest prefetch a configuration may ask for (each prefetched
# group holds its gathered parameters: deeper is memory for nothing).
MAX_PREFETCH = 8


def check_depth(name: str, value: object, lowest: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= MAX_PREFETCH:
        raise ValueError(
            f"{name} must be None or an int in [{lowest}, {MAX_PREFETCH}], got {value!r}"
        )


SCHEDULER_FIELDS = ("partition_bytes", "credit_bytes", "tail_bytes")
FSDP_FIELDS = ("forward_prefetch", "backward_prefetch", "reshard_after_forward")
# Which engine a job runs (its registration says so): autobyte's scheduler (ScheduledOptimizer and
# the integrations built on it) or FSDP2 (autobyte.fsdp). Each has its own Config fields.
ENGINES = {"scheduler": SCHEDULER_FIELDS, "fsdp2": FSDP_FIELDS}


@dataclasses.dataclass(frozen=True)
class Config:
    """A job's communication configuration. Its fields are of one engine (`ENGINES`): a config never
    mixes them. None leaves a knob as the job has it without autobyte.

    The scheduler's (autobyte.ScheduledOptimizer): partition_bytes, credit_bytes and tail_bytes;
    None means no partitioning / unlimited credit / no tail window. tail_bytes is the *tail window*:
    while a step's gradients not yet produced are at most tail_bytes (the end of the backward pass,
    where the layers the next forward needs first are produced), rank 0 issues a partition only when
    nothing is in flight, so the first layers' partitions queue behind at most one collective
    instead of a full credit window. It changes only when collectives start, never which elements
    they sum: the math is the same in every mode.

    FSDP2's (autobyte.fsdp, where ShardConfig says what each does): forward_prefetch (0-8: the
    groups each group's all-gather issues ahead in forward; 0 is FSDP2's implicit prefetch),
    backward_prefetch (1-8; 1 is FSDP2's default) and reshard_after_forward (whether every group
    below the root frees its gathered parameters after forward); None keeps the user's own setting.
    """

    # Stored as nullable columns beside every record that holds a configuration
    # (autobyte/sample_schema.py reads the kind from here).
    partition_bytes: int | None = dataclasses.field(
        default=None, metadata={"unit": "bytes", "column": "int64"}
    )
    credit_bytes: int | None = dataclasses.field(
        default=None, metadata={"unit": "bytes", "column": "int64"}
    )
    tail_bytes: int | None = dataclasses.field(
        default=None, metadata={"unit": "bytes", "column": "int64"}
    )
    forward_prefetch: int | None = dataclasses.field(
        default=None, metadata={"unit": "groups", "column": "int32"}
    )
    backward_prefetch: int | None = dataclasses.field(
        default=None, metadata={"unit": "groups", "column": "int32"}
    )
    reshard_after_forward: bool | None = dataclasses.field(
        default=None, metadata={"unit": "bool", "column": "bool"}
    )

    def __post_init__(self) -> None:
        _check_bytes(
            "partition_bytes", self.partition_bytes, MIN_PARTITION_BYTES, MAX_PARTITION_BYTES
        )
        _check_bytes("credit_bytes", self.credit_bytes, MIN_CREDIT_BYTES, MAX_CREDIT_BYTES)
        _check_bytes("tail_bytes", self.tail_bytes, MIN_TAIL_BYTES, MAX_TAIL_BYTES)
        check_depth("forward_prefetch", self.forward_prefetch, 0)
        check_depth("backward_prefetch", self.backward_prefetch, 1)
        reshard = self.reshard_after_forward
        if not isinstance(reshard, bool) and reshard in (0, 1):  # a stored 0/1 reads back as int
            object.__setattr__(self, "reshard_after_forward", bool(reshard))
        elif reshard is not None and not isinstance(reshard, bool):
            raise ValueError(f"reshard_after_forward must be a bool or None, got {reshard!r}")
        if all(self._sets(names) for names in ENGINES.values()):
            given = ", ".join(
                f"{f.name}={getattr(self, f.name)!r}"
                for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None
            )
            raise ValueError(
                f"a configuration sets knobs of one engine: {given} mixes the "
                f"scheduler's ({', '.join(SCHEDULER_FIELDS)}) with FSDP2's ({', '.join(FSDP_FIELDS)})"
            )

    def _sets(self, names: tuple[str, ...]) -> bool:
        return any(getattr(self, name) is not None for name in names)

    @property
    def engine(self) -> str | None:
        """The engine whose knobs this configuration sets (`ENGINES`); None for Config() (each
        engine as the job has it without autobyte: for the scheduler no partitioning and unlimited
        credit)."""
        return next((engine for engine, names in ENGINES.items() if self._sets(names)), None)

    def to_dict(self) -> dict[str, int | bool | None]:
        """The JSON shape the CLI documents; tail_bytes and FSDP2's knobs appear only when set
        (older readers and every configuration without them read exactly as before)."""
        shape = {"partition_bytes": self.partition_bytes, "credit_bytes": self.credit_bytes}
        for name in ("tail_bytes", *FSDP_FIELDS):
            if getattr(self, name) is not None:
                shape[name] = getattr(self, name)
        return shape

    def short(self, engine: str | None = None) -> str:
        """'4MiB/16MiB' (partition/credit; none / inf), with ' tail 8MiB' when a tail window is set;
        an FSDP2 configuration 'prefetch 2/1 reshard' (forward/backward depth, '=' where the user's
        own is kept; 'keep' for reshard_after_forward=False): the one short form of a
        configuration (status, decisions, `autobyte best`, plots). `engine`: the job's, which
        decides how Config() reads (an FSDP2 job's is 'prefetch =/=', as its script set it)."""
        if (self.engine or engine) == "fsdp2":
            depth = "/".join(
                "=" if v is None else str(v)
                for v in (self.forward_prefetch, self.backward_prefetch)
            )
            reshard = {None: "", True: " reshard", False: " keep"}[self.reshard_after_forward]
            return f"prefetch {depth}{reshard}"
        text = (
            f"{format_bytes(self.partition_bytes, 'none')}/{format_bytes(self.credit_bytes, 'inf')}"
        )
        return text if self.tail_bytes is None else f"{text} tail {format_bytes(self.tail_bytes)}"

    def describe(self, engine: str | None = None) -> str:
        """The long form; `engine` as for short()."""
        if (self.engine or engine) == "fsdp2":
            return " ".join(
                f"{name}={'as set' if getattr(self, name) is None else getattr(self, name)}"
                for name in FSDP_FIELDS
            )
        text = f"partition={format_bytes(self.partition_bytes, 'none')} credit={format_bytes(self.credit_bytes, 'unlimited')}"
        return text if self.tail_bytes is None else f"{text} tail={format_bytes(self.tail_bytes)}"

    @staticmethod
    def engine_of(configs: Iterable[Config]) -> str:
        """The engine a job's configurations set (all of one job's are one engine's): the first
        that sets any knob says it; the scheduler's when none does."""
        return next((c.engine for c in configs if c.engine is not None), "scheduler")

    def for_engine(self, engine: str) -> None:
        """ValueError unless this configuration's knobs are `engine`'s (Config() is every engine's)."""
        if self.engine not in (None, engine):
            raise ValueError(
                f"{self.describe()} sets {self.engine}'s knobs; this job runs {engine} "
                f"(its knobs: {', '.join(ENGINES[engine])})"
            )


# The one integer encoding of a configuration (rank 0's order-channel frames, the native engine's
# calls and events; native/engine.cpp reads any negative value as None in its is_unlimited()):
# NO_LIMIT_BYTES stands for None, i.e. no partitioning / unlimited credit.
NO_LIMIT_BYTES = -1


def config_to_ints(config: Config) -> tuple[int, int, int]:
    """(partition_bytes, credit_bytes, tail_bytes) with None as NO_LIMIT_BYTES."""
    return tuple(
        NO_LIMIT_BYTES if value is None else int(value)
        for value in (config.partition_bytes, config.credit_bytes, config.tail_bytes)
    )


def config_from_ints(
    partition_bytes: int, credit_bytes: int, tail_bytes: int = NO_LIMIT_BYTES
) -> Config:
    """The inverse of config_to_ints (any negative value reads as None)."""
    return Config(
        *(None if value < 0 else value for value in (partition_bytes, credit_bytes, tail_bytes))
    )


_DAY_S = 86_400.0


def metric(
    unit: str,
    column: str,
    limit: float | None = None,
    default: object = dataclasses.MISSING,
    server_default: str | None = None,
    history: bool = False,
) -> dataclasses.Field:
    """A field of StepMetrics with what every derived form needs (autobyte/sample_schema.py): its
    unit, its stored column kind ("int64", "int32" or "float"), the upper bound no real measurement
    reaches (check_metrics; None: not bounded there), the column's server default where a
    migration added the column to tables that already held rows, and whether `autobyte history
    --steps` lists it (its JSON and CSV columns, autobyte/cli.py)."""
    return dataclasses.field(
        default=default,
        metadata={
            "unit": unit,
            "column": column,
            "limit": limit,
            "server_default": server_default,
            "history": history,
        },
    )


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """What one rank measured in one optimizer step (docs/architecture.md, "The measurements of a
    step"). Times in seconds. forward_s and backward_s are compute: the waits for parameters inside
    them are exposed_comm_s, not counted.

    The one declaration of a sample's fields: the protocol conversion (autobyte/convert.py), the
    stored columns, row packing and read-back (autobyte/sample_schema.py, autobyted/storage/) and
    the value checks (METRIC_LIMITS) are derived from these fields and their metadata. A new field
    needs this line, its field in protos/autobyte/protocol/autobyte.proto and one migration."""

    step: int = metric("steps", "int64", limit=1 << 53, history=True)
    wall_time_s: float = metric(
        "s", "float", history=True
    )  # a unix time: check_metrics bounds it by the clock
    step_time_s: float = metric("s", "float", limit=_DAY_S, history=True)
    forward_s: float = metric("s", "float", limit=_DAY_S, default=0.0)
    backward_s: float = metric("s", "float", limit=_DAY_S, default=0.0)
    exposed_comm_s: float = metric("s", "float", limit=_DAY_S, default=0.0, history=True)
    queueing_delay_s: float = metric("s", "float", limit=_DAY_S, default=0.0)
    bytes_reduced: int = metric("bytes", "int64", limit=1 << 50, default=0, history=True)
    partitions: int = metric("partitions", "int32", limit=100_000_000, default=0)
    bandwidth_bytes_per_s: float = metric("bytes/s", "float", limit=1e13, default=0.0)
    # The configuration the step ran with: stored as Config's own fields' columns.
    config: Config = Config()
    decision_id: int = metric("id", "int64", limit=1 << 62, default=0)
    # Share of the host's CPU capacity used by other processes over the last second, in [0, 1]
    # (autobyte.hostload); 0.0 = unknown.
    host_load: float = metric(
        "share of the host's CPU", "float", limit=1e3, default=0.0, server_default="0"
    )
    # This rank's most queued link over the last second (autobyte.tcplinks): how far the smoothed
    # round-trip time of its most delayed collective socket stood above that socket's minimum, and
    # 1 + the rank at that socket's far end; 0.0 and 0 = unknown.
    link_queue_s: float = metric("s", "float", limit=_DAY_S, default=0.0, server_default="0")
    link_peer: int = metric("1 + rank", "int32", limit=1 << 24, default=0, server_default="0")


# Upper bounds no real measurement reaches; a value beyond them is a bug, not a measurement.
METRIC_LIMITS = {
    f.name: f.metadata["limit"]
    for f in dataclasses.fields(StepMetrics)
    if f.metadata.get("limit") is not None
}


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


def speedup(reference_step_time_s: float, step_time_s: float) -> float:
    """The one speed-up figure autobyte shows (status, decision reasons, `autobyte best`): how many
    times faster a configuration runs than a reference, the reference's median step time over the
    configuration's, both measured (or predicted) in the same context. 2.0 = twice the steps per
    second; below 1 = slower. ValueError for a time that is not positive."""
    if not (reference_step_time_s > 0 and step_time_s > 0):
        raise ValueError(
            f"a speed-up needs two positive step times, got {reference_step_time_s!r} "
            f"and {step_time_s!r}"
        )
    return reference_step_time_s / step_time_s


def describe_speedup(value: float, reference: str) -> str:
    """'1.31x faster than 4MiB/16MiB'; a value below 1 reads '0.85x as fast as ...' (same figure)."""
    return f"{value:.2f}x {'faster than' if value >= 1 else 'as fast as'} {reference}"


def format_bytes(value: int | None, none: str = "-") -> str:
    """1048576 -> '1MiB', 4000000 -> '4MB' (a size given in powers of 10 reads back as given);
    None -> `none`."""
    if value is None:
        return none
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= 1 << shift and value % (1 << shift) == 0:
            return f"{value >> shift}{unit}"
    for unit, scale in (("GB", 10**9), ("MB", 10**6)):
        if value >= scale and value % scale == 0:
            return f"{value // scale}{unit}"
    if value >= 1 << 20:
        return f"{value / (1 << 20):.1f}MiB"
    if value >= 1000 and value % 1000 == 0:
        return f"{value // 1000}KB"
    return f"{value}B"


# What a size's unit means (`autobyte propose --help` and docs/reference.md say the same): the IEC units
# and the bare letters are powers of 2, the SI units powers of 10, as GNU coreutils reads them.
BYTE_UNITS = {
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}
BYTE_UNITS_HELP = (
    "KiB/MiB/GiB (or K/M/G) are powers of 2, KB/MB/GB powers of 10: 4MB = 4000000 bytes"
)


def parse_bytes(text: str) -> int | None:
    """'4MiB', '4m', '4MB', '4096', 'none', 'unlimited' -> bytes (None for none/unlimited); see
    BYTE_UNITS for what each unit means (4MiB = 4194304, 4MB = 4000000)."""
    raw = text.strip().lower()
    if raw in ("none", "unlimited", "inf", "null"):
        return None
    for suffix in sorted(BYTE_UNITS, key=len, reverse=True):
        if raw.endswith(suffix):
            number = raw[: -len(suffix)]
            scale = BYTE_UNITS[suffix]
            break
    else:
        number, scale = raw, 1
    try:
        value = float(number)
    except ValueError:
        raise ValueError(
            f"not a byte size: {text!r} (examples: 4096, 256KiB, 4MiB, 4MB, none)"
        ) from None
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
    return TensorSizes(
        parameter_bytes=sum(sizes),
        tensor_count=len(sizes),
        largest_tensor_bytes=max(sizes, default=0),
        median_tensor_bytes=int(statistics.median(sizes)) if sizes else 0,
    )
