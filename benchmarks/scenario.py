"""Scenario files (benchmarks/scenarios/*.toml): model, workers, bandwidth trace, duration.

The format is documented in benchmarks/README.md ("Scenario format"). A scenario is loaded once
into a frozen `Scenario`; `make_simulator()` builds a fresh simulator for it.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import tomllib
from typing import Any

from benchmarks.sim.engine import LinkModel, Simulator
from benchmarks.sim.profiles import DEFAULT_DEVICE_FLOPS_PER_S, ModelProfile, load_profile
from benchmarks.sim.trace import Trace, trace_from_spec

GBIT = 1e9 / 8  # bytes per second in one Gbit/s

_TOP_KEYS = {"name", "description", "model", "batch_size", "device_flops_per_s", "compute_scale",
             "workers", "duration_s", "duration_steps", "seed", "link", "bandwidth", "compute",
             "testbed"}


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    model: str
    profile: ModelProfile  # already scaled by compute_scale
    workers: int
    bandwidth: Trace  # bytes/s
    compute: Trace  # compute-time multiplier (1 = nominal)
    link: LinkModel
    duration_s: float | None
    duration_steps: int | None
    seed: int
    path: str = ""
    testbed: dict[str, Any] = dataclasses.field(default_factory=dict)

    def make_simulator(self) -> Simulator:
        return Simulator(self.profile, self.workers, self.bandwidth, self.link, self.compute)

    def phases(self, until_s: float = math.inf) -> list[tuple[float, float, float, float]]:
        """(start_s, end_s, bandwidth bytes/s, compute factor) wherever either trace changes."""
        points = sorted({t for t in self.bandwidth.times_s + self.compute.times_s if t < until_s})
        out: list[tuple[float, float, float, float]] = []
        for index, start in enumerate(points):
            end = points[index + 1] if index + 1 < len(points) else until_s
            values = (self.bandwidth.at(start), self.compute.at(start))
            if out and out[-1][2:] == values:
                out[-1] = (out[-1][0], end, *values)
            else:
                out.append((start, end, *values))
        return out


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
        base = load_profile(model_ref, data.get("batch_size"),
                            float(data.get("device_flops_per_s", DEFAULT_DEVICE_FLOPS_PER_S)))
        profile = base.scaled(float(data.get("compute_scale", 1.0)))
        horizon = _trace_horizon_s(data)
        bandwidth = trace_from_spec(data["bandwidth"], horizon, GBIT)
        compute = trace_from_spec(data.get("compute", {"kind": "constant", "value": 1.0}), horizon)
        link = LinkModel(**data.get("link", {}))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    workers = int(data["workers"])
    if workers < 1:
        raise ValueError(f"{path}: workers must be >= 1")
    return Scenario(
        name=str(data.get("name", path.stem)), description=str(data.get("description", "")),
        model=model, profile=profile, workers=workers, bandwidth=bandwidth, compute=compute,
        link=link,
        duration_s=float(data["duration_s"]) if "duration_s" in data else None,
        duration_steps=int(data["duration_steps"]) if "duration_steps" in data else None,
        seed=int(data.get("seed", 0)), path=str(path), testbed=dict(data.get("testbed", {})))
