"""Discrete-event simulator of data-parallel training under the autobyte scheduler and DDP, and
of FSDP2's step under its knobs (autobyted/tuner/shard_schedule.py)."""

from autobyted.tuner.shard_schedule import (
    ShardedModel,
    ShardedStep,
    ShardGroup,
    ShardLink,
    simulate_step,
)
from simulator.engine import (
    DDP,
    DDPConfig,
    LinkModel,
    RunConfig,
    SimulatedStep,
    Simulator,
    describe_config,
    lower_bound_step_s,
    ring_allreduce_s,
    sparse_wire,
)
from simulator.profiles import (
    BUILTIN_PROFILES,
    LayerProfile,
    ModelProfile,
    RowSparseTable,
    bert_base,
    load_profile,
    record_profile,
    resnet50,
    vgg16,
)
from simulator.trace import (
    PiecewiseConstant,
    periodic_trace,
    ramp_trace,
    step_trace,
    trace_from_spec,
)

__all__ = [
    "BUILTIN_PROFILES",
    "DDP",
    "DDPConfig",
    "LayerProfile",
    "LinkModel",
    "ModelProfile",
    "PiecewiseConstant",
    "RowSparseTable",
    "RunConfig",
    "ShardGroup",
    "ShardLink",
    "ShardedModel",
    "ShardedStep",
    "SimulatedStep",
    "Simulator",
    "bert_base",
    "describe_config",
    "load_profile",
    "lower_bound_step_s",
    "periodic_trace",
    "ramp_trace",
    "record_profile",
    "resnet50",
    "ring_allreduce_s",
    "simulate_step",
    "sparse_wire",
    "step_trace",
    "trace_from_spec",
    "vgg16",
]
