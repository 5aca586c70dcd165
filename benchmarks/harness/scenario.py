"""Scenario files (benchmarks/scenarios/*.toml): model, workers, bandwidth trace, duration.

The format is documented in docs/benchmarks.md ("Scenario format"). A scenario is loaded once
into a frozen `Scenario`; `make_simulator()` builds a fresh simulator for it.

Optional condition keys (files without them load and behave exactly as before). Each is a
trace table of the same kinds as [bandwidth] and describes the slowest worker, which sets the pace
of every collective (the other workers wait for it):

    [traffic]    competing TCP flows on that worker's link (a count; 0 = none): the job keeps
                 1 / (1 + flow_weight * flows) of the link, and every collective pays
                 [link] flow_message_extra_s once per flow (TCP ramping up behind the flow's queue)
    [cpu]        cores that worker has (1 = a full core, as measured; 0.5 = a busy node): compute
                 1/cpu times slower, and the communication's CPU load weighs 1/cpu times more
    [straggler]  that worker's link in Gbit/s: the ring runs at min(bandwidth, straggler)

`Scenario.bandwidth` is the job's bandwidth after those (what the simulator uses); the link as set
is `link_bandwidth`. With condition keys, `phases()` yields (start, end, bandwidth, compute,
flows, cpu share) instead of (start, end, bandwidth, compute), and `testbed_trace()` turns the
scenario into a testbed trace (conditions on rank 1, the other ranks' links at `bandwidth`; the
CPU quota on the last `quota_workers` ranks when [link] quota_period_s > 0).

The testbed trains the [testbed] table's `model` (a workload of benchmarks/testbed/models.py), or with
`mode = "emulated"` the scenario's own profile on an emulated accelerator (benchmarks/testbed/emulated.py):
the top-level model, batch_size, device_flops_per_s and compute_scale, with every tensor's size and
every link's rate divided by [testbed] `byte_scale` (default 1), on `workers` ranks (`max_workers`
caps them; 2 by default for real models, which take a core each). `testbed_workload()` is what a
rank is given.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import tomllib
from typing import Any

from simulator.engine import LinkModel, Simulator
from simulator.profiles import DEFAULT_DEVICE_FLOPS_PER_S, ModelProfile, load_profile
from simulator.trace import PiecewiseConstant, trace_from_spec

GBIT = 1e9 / 8  # bytes per second in one Gbit/s

_TOP_KEYS = {
    "name",
    "description",
    "model",
    "batch_size",
    "device_flops_per_s",
    "compute_scale",
    "workers",
    "duration_s",
    "duration_steps",
    "seed",
    "link",
    "bandwidth",
    "compute",
    "testbed",
    "traffic",
    "cpu",
    "straggler",
}
CONDITION_KEYS = ("traffic", "cpu", "straggler")


TESTBED_MODES = ("real", "emulated")


@dataclasses.dataclass(frozen=True)
class TestbedWorkload:
    """What each testbed rank trains: benchmarks.testbed.train_worker's --model, --model-args, --batch-size."""

    __test__ = False  # not a pytest test class
    model: str
    model_args: dict[str, Any]
    batch_size: int  # 0: the workload's default
    workers: int

    def worker_args(self) -> list[str]:
        import json

        return [
            "--model",
            self.model,
            "--model-args",
            json.dumps(self.model_args),
            "--batch-size",
            str(self.batch_size),
        ]


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    model: str
    profile: ModelProfile  # already scaled by compute_scale
    workers: int
    bandwidth: PiecewiseConstant  # bytes/s
    compute: PiecewiseConstant  # compute-time multiplier (1 = nominal)
    link: LinkModel
    duration_s: float | None
    duration_steps: int | None
    seed: int
    path: str = ""
    testbed: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Optional conditions (see the module docstring); None = absent.
    link_bandwidth: PiecewiseConstant | None = None  # bytes/s as set, before straggler and traffic
    flows: PiecewiseConstant | None = None  # competing TCP flows on the slowest worker's link
    cpu_share: PiecewiseConstant | None = None  # cores of the slowest worker
    straggler: PiecewiseConstant | None = None  # bytes/s of the slowest worker's link
    # How the profile was given (emulated testbed ranks load it the same way).
    model_ref: str = ""  # the model key, a relative profile path resolved against the file
    batch_size: int | None = None
    device_flops_per_s: float = DEFAULT_DEVICE_FLOPS_PER_S
    compute_scale: float = 1.0

    @property
    def emulated(self) -> bool:
        return self.testbed.get("mode", "real") == "emulated"

    @property
    def byte_scale(self) -> float:
        """What the testbed divides tensor sizes and link rates by (emulated mode; 1 otherwise)."""
        return float(self.testbed.get("byte_scale", 1.0)) if self.emulated else 1.0

    def testbed_burst(self) -> int | None:
        """The tbf burst of an emulated scenario's links, in bytes on the wire: the smallest that
        keeps the highest rate its links run at (`benchmarks.testbed.bed.burst_for`: a larger one
        moves a scaled collective faster than the rate). None: the testbed's default (real mode)."""
        if not self.emulated:
            return None
        from benchmarks.testbed.bed import burst_for

        link = self.link_bandwidth or self.bandwidth
        top = max(link.values)
        if self.straggler is not None:
            top = max(top, max(self.straggler.values))
        return burst_for(int(top / self.byte_scale * 8))

    def testbed_workload(self, workers: int | None = None) -> TestbedWorkload:
        """The testbed's model for this scenario (see the module docstring); `workers` overrides
        the scenario's count."""
        count = self.workers if workers is None else workers
        if not self.emulated:
            return TestbedWorkload(
                str(self.testbed.get("model", "mlp")),
                dict(self.testbed.get("model_args", {})),
                int(self.testbed.get("batch_size", 0)),
                min(count, int(self.testbed.get("max_workers", 2))),
            )
        profile = (
            self.model_ref
        )  # a recorded profile: absolute, as ranks start in another directory
        if profile.endswith(".json"):
            profile = str(pathlib.Path(profile).resolve())
        args = {
            "profile": profile,
            "device_flops_per_s": self.device_flops_per_s,
            "compute_scale": self.compute_scale,
            "byte_scale": self.byte_scale,
        }
        if self.batch_size is not None:
            args["batch_size"] = self.batch_size
        return TestbedWorkload(
            "emulated", args, 0, min(count, int(self.testbed.get("max_workers", count)))
        )

    @property
    def has_conditions(self) -> bool:
        return any(t is not None for t in (self.flows, self.cpu_share, self.straggler))

    def make_simulator(self) -> Simulator:
        return Simulator(
            self.profile,
            self.workers,
            self.bandwidth,
            self.link,
            self.compute,
            flows_trace=self.flows,
            cpu_share_trace=self.cpu_share,
        )

    def phases(self, until_s: float = math.inf) -> list[tuple[float, ...]]:
        """(start_s, end_s, bandwidth bytes/s, compute factor) wherever a trace changes; with
        condition keys also (..., competing flows, cpu share) — what steady_step_s takes."""
        traces = [self.bandwidth, self.compute]
        if self.has_conditions:
            traces += [
                self.flows or PiecewiseConstant.constant(0.0, nonnegative=True),
                self.cpu_share or PiecewiseConstant.constant(1.0),
            ]
        points = sorted({t for trace in traces for t in trace.times_s if t < until_s})
        out: list[tuple[float, ...]] = []
        for index, start in enumerate(points):
            end = points[index + 1] if index + 1 < len(points) else until_s
            values = tuple(trace.at(start) for trace in traces)
            if out and out[-1][2:] == values:
                out[-1] = (out[-1][0], end, *values)
            else:
                out.append((start, end, *values))
        return out

    def testbed_trace(self, until_s: float = math.inf, rank: int = 1) -> Any:
        """The scenario as a `benchmarks.testbed.Trace`, timed from train_start: every link at
        the set bandwidth; the straggler link, competing flows and CPU share on `rank`."""
        from benchmarks import testbed as harness

        def pairs(trace: PiecewiseConstant, fmt: Any) -> list[tuple[float, Any]]:
            return [(start, fmt(value)) for start, _end, value in trace.phases(until_s)]

        def mbit(value: float) -> str:  # on the wire: divided by the emulation's byte scale
            return f"{value / self.byte_scale / GBIT * 1000:.0f}mbit"

        link = self.link_bandwidth or self.bandwidth
        trace = harness.Trace.from_times(pairs(link, mbit))
        if self.straggler is not None:
            trace += harness.Trace.from_times(
                pairs(self.straggler.combine(link, min), mbit), ranks=[rank]
            )
        if self.flows is not None:
            trace += harness.Trace.flows(pairs(self.flows, lambda v: round(v)), ranks=[rank])
        if self.cpu_share is not None:
            # a quota on `quota_workers` workers (the last ones) when the link model says so
            throttled = self.link.quota_workers if self.link.quota_period_s > 0 else 1
            workers = self.testbed_workload().workers
            ranks = [rank] if throttled <= 1 else list(range(max(0, workers - throttled), workers))
            trace += harness.Trace.cpu_share(
                pairs(self.cpu_share, lambda v: None if v >= 1.0 else v), ranks=ranks
            )
        return trace


def _trace_horizon_s(data: dict[str, Any]) -> float:
    if "duration_s" in data:
        return float(data["duration_s"])
    return 1e7  # periodic traces in step-bounded scenarios: long enough for any run


def load_scenario(path: str | pathlib.Path) -> Scenario:
    """Parse and validate one scenario file; errors name the file and the key."""
    path = pathlib.Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)} (known: {sorted(_TOP_KEYS)})")
    for key in ("model", "workers", "bandwidth"):
        if key not in data:
            raise ValueError(f"{path}: missing required key {key!r}")
    if ("duration_s" in data) == ("duration_steps" in data):
        raise ValueError(f"{path}: give exactly one of duration_s or duration_steps")
    model = str(data["model"])
    model_ref = model
    if model.endswith(".json") and not pathlib.Path(model).is_absolute():
        model_ref = str(path.parent / model)
    try:
        base = load_profile(
            model_ref,
            data.get("batch_size"),
            float(data.get("device_flops_per_s", DEFAULT_DEVICE_FLOPS_PER_S)),
        )
        profile = base.scaled(float(data.get("compute_scale", 1.0)))
        horizon = _trace_horizon_s(data)
        bandwidth = trace_from_spec(data["bandwidth"], horizon, GBIT)
        compute = trace_from_spec(data.get("compute", {"kind": "constant", "value": 1.0}), horizon)
        link = LinkModel(**data.get("link", {}))
        conditions: dict[str, Any] = {}
        if "traffic" in data:
            conditions["flows"] = trace_from_spec(data["traffic"], horizon, nonnegative=True)
        if "cpu" in data:
            conditions["cpu_share"] = trace_from_spec(data["cpu"], horizon)
        if "straggler" in data:
            conditions["straggler"] = trace_from_spec(data["straggler"], horizon, GBIT)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if conditions:
        conditions["link_bandwidth"] = bandwidth
        if "straggler" in conditions:
            bandwidth = bandwidth.combine(conditions["straggler"], min)
        if "flows" in conditions:
            bandwidth = bandwidth.combine(
                conditions["flows"], lambda bw, flows: bw * link.flow_share(flows)
            )
    workers = int(data["workers"])
    if workers < 1:
        raise ValueError(f"{path}: workers must be >= 1")
    testbed = dict(data.get("testbed", {}))
    if testbed.get("mode", "real") not in TESTBED_MODES:
        raise ValueError(f"{path}: [testbed] mode {testbed['mode']!r}: use one of {TESTBED_MODES}")
    try:
        byte_scale = float(testbed.get("byte_scale", 1.0))
    except (TypeError, ValueError):
        byte_scale = 0.0
    if not byte_scale >= 1.0:
        raise ValueError(
            f"{path}: [testbed] byte_scale {testbed.get('byte_scale')!r} must be a "
            "number >= 1 (it divides tensor sizes and link rates)"
        )
    return Scenario(
        name=str(data.get("name", path.stem)),
        description=str(data.get("description", "")),
        model=model,
        profile=profile,
        workers=workers,
        bandwidth=bandwidth,
        compute=compute,
        link=link,
        duration_s=float(data["duration_s"]) if "duration_s" in data else None,
        duration_steps=int(data["duration_steps"]) if "duration_steps" in data else None,
        seed=int(data.get("seed", 0)),
        path=str(path),
        testbed=testbed,
        model_ref=model_ref,
        batch_size=int(data["batch_size"]) if "batch_size" in data else None,
        device_flops_per_s=float(data.get("device_flops_per_s", DEFAULT_DEVICE_FLOPS_PER_S)),
        compute_scale=float(data.get("compute_scale", 1.0)),
        **conditions,
    )
