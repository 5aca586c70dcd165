"""Frozen values of what the protocol carries about jobs: a rank's registration, decisions, tuner
states, job status, history steps and the best configuration. autobyte.convert turns them into
messages and back; the daemon's storage returns them (autobyted.storage.records re-exports them)."""

from __future__ import annotations

import dataclasses
import json

from autobyte.types import Config, StepMetrics


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    parameter_count: int = 0
    parameter_bytes: int = 0
    tensor_count: int = 0
    largest_tensor_bytes: int = 0
    median_tensor_bytes: int = 0
    digest: str = ""


@dataclasses.dataclass(frozen=True)
class Registration:
    job: str
    rank: int
    world_size: int
    backend: str
    instance_id: str
    fingerprint: Fingerprint = Fingerprint()
    config: Config = Config()
    hostname: str = ""
    pid: int = 0
    tuning_disabled: bool = False
    engine: str = "scheduler"  # autobyte.types.ENGINES: whose Config fields the job's configs set
    memory: MemoryLimits | None = None  # an FSDP2 job's budget (autobyte.fsdp), where it set one
    # one small all-reduce on the job's group, measured at construction (0.0: unknown;
    # autobyte.scheduler.start.measure_latency)
    collective_latency_s: float = 0.0
    shard_layout: ShardLayout | None = None  # an FSDP2 job's groups (autobyte.fsdp)


MAX_SHARD_GROUPS = 100_000  # groups a registration may name (a model of that many is not FSDP2's)


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """An FSDP2 job's groups as the daemon's model of its schedule needs them
    (autobyted/tuner/shard_schedule.py): each group's gathered parameter bytes in forward order,
    the root's own (gathered for the whole step), and whether its all-gathers leave the training
    thread (autobyte.fsdp's asynchronous ones) or hold it (FSDP2's own on gloo)."""

    group_bytes: tuple[int, ...]
    root_bytes: int = 0
    async_gathers: bool = False

    def __post_init__(self) -> None:
        if not 0 < len(self.group_bytes) <= MAX_SHARD_GROUPS:
            raise ValueError(
                f"a shard layout names 1 to {MAX_SHARD_GROUPS} groups, got {len(self.group_bytes)}"
            )
        for name, value in (
            ("root_bytes", self.root_bytes),
            *((f"group_bytes[{i}]", b) for i, b in enumerate(self.group_bytes)),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 50:
                raise ValueError(f"shard layout {name} must be bytes in [0, 2**50), got {value!r}")
        if not any(self.group_bytes):
            raise ValueError("a shard layout's groups hold no bytes")

    def to_json(self) -> str:
        return json.dumps(
            {
                "group_bytes": list(self.group_bytes),
                "root_bytes": self.root_bytes,
                "async_gathers": self.async_gathers,
            },
            sort_keys=True,
        )

    @classmethod
    def stored(cls, text: str | None) -> ShardLayout | None:
        """What `to_json` stored (None: no layout)."""
        if not text:
            return None
        d = json.loads(text)
        return cls(tuple(d["group_bytes"]), d["root_bytes"], d["async_gathers"])


MAX_OVER_BUDGET = 256  # configurations a registration may name over its budget (the proto's limit)


@dataclasses.dataclass(frozen=True)
class MemoryLimits:
    """An FSDP2 job's memory budget and the configurations its ranks predict over it
    (autobyte.fsdp.ShardedJob.over_budget): the daemon never decides one."""

    budget_bytes: int
    over_budget: frozenset[Config] = frozenset()

    def __post_init__(self) -> None:
        if isinstance(self.budget_bytes, bool) or not isinstance(self.budget_bytes, int):
            raise ValueError(f"memory_budget_bytes must be an int, got {self.budget_bytes!r}")
        if self.budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be positive, got {self.budget_bytes}")
        if len(self.over_budget) > MAX_OVER_BUDGET:
            raise ValueError(
                f"over_budget names {len(self.over_budget)} configurations; at most "
                f"{MAX_OVER_BUDGET} (FSDP2's knobs have 60 points)"
            )
        for config in self.over_budget:
            config.for_engine("fsdp2")

    def over_budget_json(self) -> str:
        """The configurations as stored (a JSON list of their set fields, in a stable order)."""
        return json.dumps(
            sorted(
                (
                    {k: v for k, v in dataclasses.asdict(c).items() if v is not None}
                    for c in self.over_budget
                ),
                key=lambda d: json.dumps(d, sort_keys=True),
            ),
            sort_keys=True,
        )

    @classmethod
    def stored(cls, budget_bytes: int | None, over_budget_json: str | None) -> MemoryLimits | None:
        """What `over_budget_json` stored (None: no budget)."""
        if budget_bytes is None:
            return None
        configs = json.loads(over_budget_json or "[]")
        return cls(budget_bytes, frozenset(Config(**c) for c in configs))

    def allows(self, config: Config) -> bool:
        return config not in self.over_budget

    def refusal(self, config: Config) -> str:
        """Why `config` is never decided (for people)."""
        return (
            f"{config.describe()} is predicted over the job's memory budget of "
            f"{self.budget_bytes:,} bytes of gathered parameters (autobyte.fsdp's "
            "memory_budget_bytes); choose fewer prefetched or kept groups"
        )


@dataclasses.dataclass(frozen=True)
class DecisionRecord:
    decision_id: int
    job: str
    config: Config
    apply_at_step: int
    reason: str
    created_at_s: float
    state: str
    predicted_step_time_s: float | None = None
    measured_step_time_s: float | None = None
    applied_at_step: int | None = None
    source: str = "operator"


@dataclasses.dataclass(frozen=True)
class JobRecord:
    job: str
    state: str
    world_size: int
    backend: str
    steps: int
    config: Config
    ranks: tuple[int, ...]
    recent_step_time_s: float
    last_seen_s: float
    dropped_total: int
    last_decision: DecisionRecord | None
    tuner: TunerStatusRecord | None = None
    tuning_disabled: bool = False
    engine: str = "scheduler"


@dataclasses.dataclass(frozen=True)
class HistoryStep:
    """One rank's step as the Query service's History answers it (the proto's StepRecord)."""

    step: int
    rank: int
    wall_time_s: float
    step_time_s: float
    exposed_comm_s: float
    bytes_reduced: int
    config: Config
    forward_s: float = 0.0
    backward_s: float = 0.0
    bandwidth_bytes_per_s: float = 0.0
    host_load: float = 0.0
    decision_id: int = 0


def history_step(rank: int, metrics: StepMetrics) -> HistoryStep:
    """A stored sample as History answers it: HistoryStep's fields are a subset of StepMetrics'."""
    return HistoryStep(
        rank=rank, **{name: getattr(metrics, name) for name in _HISTORY_METRIC_FIELDS}
    )


_HISTORY_METRIC_FIELDS = tuple(f.name for f in dataclasses.fields(HistoryStep) if f.name != "rank")


@dataclasses.dataclass(frozen=True)
class CandidateRecord:
    """One configuration measured on a job: median rank-0 step time over its steps past warm-up."""

    config: Config
    median_step_time_s: float
    samples: int
    speedup: float = (
        0.0  # autobyte.types.speedup over the context's reference; 0: not measured there
    )


@dataclasses.dataclass(frozen=True)
class BestRecord:
    job: str
    found: bool
    config: Config = Config()
    median_step_time_s: float = 0.0
    samples: int = 0
    baseline_step_time_s: float = 0.0
    evidence: str = ""
    candidates: tuple[CandidateRecord, ...] = ()  # every configuration compared, fastest first
    context: str = ""  # which context (autobyted.contexts) the comparison is made in
    reference: Config = Config()  # the configuration the speed-ups are relative to
    reference_step_time_s: float = 0.0
    contexts: int = 0


@dataclasses.dataclass(frozen=True)
class TunerStatusRecord:
    """What the tuner is doing for a job (see autobyted/tuner/phases/__init__.py for the states)."""

    mode: str
    state: str
    detail: str
    config: Config = Config()
    baseline_step_time_s: float = 0.0
    measured_step_time_s: float = 0.0
    predicted_step_time_s: float = 0.0
    trials_done: int = 0
    trials_planned: int = 0
    paused: bool = False
    updated_at_s: float = 0.0
