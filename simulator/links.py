"""The testbed's gloo as the simulator's link: the per-collective costs measured on this host
(benchmarks/calibration/), for the simulator against the emulated testbed
(benchmarks/sim_vs_emulated.py) and for the prior's emulated contexts (simulator/train_prior.py).

- `gloo_link`: a link with this testbed's 2-rank gloo costs (optimum-map.report.json "constants":
  gloo over veth on this host, the cost of a collective behind a competing flow by message size).
  A collective's fixed cost is time, which the byte scale does not divide; the by-size tables are
  in wire bytes, so their sizes are multiplied by the byte scale into the model's.
- `gloo_n_link`: the same with the per-collective cost measured at the job's rank count
  (gloo-collective.json, written by `benchmarks.bench_collective`: the fitted latency of a stream
  of all-reduces with the credit window's partitions in flight). At N ranks a collective is a ring
  of 2(N-1) hops through N processes that share the host's cores; that cost overlaps the wire time
  (`LinkModel.fixed_overlaps_wire`): a hop waits for its processes to be scheduled while the shaped
  link drains the bytes of the other collectives in flight.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from typing import Any

from simulator.engine import LinkModel

CALIBRATION = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "calibration"
GLOO_LINK = CALIBRATION / "optimum-map.report.json"
GLOO_LINK_KEYS = ("collective_overhead_s", "launch_s")
GLOO_BY_SIZE_KEYS = ("message_extra_s", "flow_message_extra_s")
GLOO_COLLECTIVE = CALIBRATION / "gloo-collective.json"


@functools.cache
def _read(path: pathlib.Path) -> Any:
    return json.loads(path.read_text())


def gloo_link(link: LinkModel, byte_scale: float) -> LinkModel:
    """`link` with this testbed's per-collective costs (GLOO_LINK's calibration); the by-size
    tables' wire sizes in the model's bytes."""
    measured = _read(GLOO_LINK)["constants"]
    costs: dict[str, Any] = {key: float(measured[key]) for key in GLOO_LINK_KEYS}
    costs["latency_s"] = 0.0  # in collective_overhead_s (measured per collective)
    for key in GLOO_BY_SIZE_KEYS:
        if key in measured:
            costs[key] = tuple((size * byte_scale, seconds) for size, seconds in measured[key])
    return dataclasses.replace(link, **costs)


def collective_cost_s(
    ranks: int, path: pathlib.Path = GLOO_COLLECTIVE, in_flight: int | None = None
) -> float:
    """The fitted per-collective latency at `ranks` gloo ranks on this host, with `in_flight`
    collectives in flight (None: the credit window's partitions; one where the file has no such
    column)."""
    from autobyte.scheduler.start import CREDIT_PARTITIONS

    measured = _read(path)["ranks"]
    if str(ranks) not in measured:
        raise ValueError(
            f"{path.name} has no measurement at {ranks} ranks (it has {sorted(measured, key=int)}): "
            f"run python -m benchmarks.bench_collective --ranks {ranks} --in-flight "
            f"1,{CREDIT_PARTITIONS}"
        )
    by_flight = measured[str(ranks)]
    column = by_flight.get(str(CREDIT_PARTITIONS if in_flight is None else in_flight))
    column = column or by_flight["1"]
    return max(0.0, float(column["latency_s"]))


def lone_collective_s(ranks: int, path: pathlib.Path = GLOO_COLLECTIVE) -> float:
    """A small all-reduce at `ranks` gloo ranks on this host, one at a time, as a rank measures
    it when its scheduler is built (autobyte.scheduler.start.measure_latency: the per-collective
    cost its registration carries; `python -m benchmarks.bench_collective --lone` writes it): the
    measured rank counts' figures, interpolated in log2(ranks) between them, the nearest beyond
    them. Above a partition's fixed cost among several in flight (collective_cost_s), as one at a
    time pays every hop's wait for its process to be scheduled."""
    if ranks <= 1:
        return 0.0
    measured = {int(r): float(s) for r, s in _read(path)["lone_latency_s"].items()}
    if ranks in measured:
        return measured[ranks]
    counts = sorted(measured)
    below = max((r for r in counts if r < ranks), default=counts[0])
    above = min((r for r in counts if r > ranks), default=counts[-1])
    if below == above:
        return measured[below]
    w = (math.log2(ranks) - math.log2(below)) / (math.log2(above) - math.log2(below))
    return measured[below] + w * (measured[above] - measured[below])


def gloo_n_link(link: LinkModel, byte_scale: float, ranks: int) -> LinkModel:
    """`gloo_link` with the per-collective cost measured at `ranks`, overlapping the wire time."""
    return dataclasses.replace(
        gloo_link(link, byte_scale),
        collective_overhead_s=collective_cost_s(ranks),
        fixed_overlaps_wire=True,
        lone_collective_s=lone_collective_s(ranks),
    )
