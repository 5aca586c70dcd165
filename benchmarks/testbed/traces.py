"""Traces: the timed rate and condition changes a testbed applies while its ranks run."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from benchmarks.testbed.rates import parse_rate

if TYPE_CHECKING:
    from benchmarks.testbed.bed import Testbed


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Timed:
    """When a trace change applies: at `at_s` seconds (from train_start) or at rank 0's `at_step`;
    to which ranks (None: all)."""

    at_s: float | None = None
    at_step: int | None = None
    ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if (self.at_s is None) == (self.at_step is None):
            raise ValueError(f"a {type(self).__name__} needs exactly one of at_s and at_step")


@dataclasses.dataclass(frozen=True)
class RateChange(_Timed):
    """Set the rate of the ranks' links."""

    rate_bps: int

    def apply(self, bed: Testbed) -> dict[str, Any]:
        bed.set_rate(self.rate_bps, self.ranks)
        return {"rate_bps": self.rate_bps}


@dataclasses.dataclass(frozen=True)
class CpuShareChange(_Timed):
    """Limit the ranks' processes to `cpu_share` cores (cgroup CPU quota); None lifts the limit."""

    cpu_share: float | None

    def apply(self, bed: Testbed) -> dict[str, Any]:
        bed.set_cpu_share(self.cpu_share, self.ranks)
        return {"condition": "cpu_share", "cpu_share": self.cpu_share}


@dataclasses.dataclass(frozen=True)
class BusyChange(_Timed):
    """Run `processes` busy loops inside each rank's namespace (0 stops them)."""

    processes: int

    def apply(self, bed: Testbed) -> dict[str, Any]:
        stopped = bed.set_busy(self.processes, self.ranks)
        return {"condition": "busy", "processes": self.processes, "stopped": stopped}


@dataclasses.dataclass(frozen=True)
class FlowChange(_Timed):
    """Run `flows` competing TCP flows through each rank's link (0 stops them); `direction`:
    "out" (from the rank), "in" (to the rank) or "both" (`flows` each way)."""

    flows: int
    direction: str = "both"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.direction not in FLOW_DIRECTIONS:
            raise ValueError(f"flow direction {self.direction!r}: use one of {FLOW_DIRECTIONS}")

    def apply(self, bed: Testbed) -> dict[str, Any]:
        stopped = bed.set_flows(self.flows, self.ranks, self.direction)
        return {
            "condition": "flows",
            "flows": self.flows,
            "direction": self.direction,
            "stopped": stopped,
        }


Change = RateChange | CpuShareChange | BusyChange | FlowChange
FLOW_DIRECTIONS = ("out", "in", "both")


def _when(t: float, by: str) -> dict[str, Any]:
    if by == "s":
        return {"at_s": float(t)}
    if by == "step":
        return {"at_step": int(t)}
    raise ValueError(f"a trace is timed by 's' or 'step', not {by!r}")


@dataclasses.dataclass(frozen=True)
class Trace:
    """A trace of rate and condition changes applied while the ranks run (`a + b` merges two)."""

    changes: tuple[Change, ...] = ()

    @classmethod
    def from_times(
        cls, pairs: Iterable[tuple[float, str | int]], ranks: Sequence[int] | None = None
    ) -> Trace:
        """[(t_seconds, rate), ...]; t is measured from the first {"event": "train_start"}."""
        ranks_t = tuple(ranks) if ranks is not None else None
        return cls(tuple(RateChange(parse_rate(r), at_s=float(t), ranks=ranks_t) for t, r in pairs))

    @classmethod
    def from_steps(
        cls, pairs: Iterable[tuple[int, str | int]], ranks: Sequence[int] | None = None
    ) -> Trace:
        """[(step, rate), ...]; applied when rank 0 reports {"event": "step", "step": n ≥ step}."""
        ranks_t = tuple(ranks) if ranks is not None else None
        return cls(
            tuple(RateChange(parse_rate(r), at_step=int(s), ranks=ranks_t) for s, r in pairs)
        )

    @classmethod
    def cpu_share(
        cls,
        pairs: Iterable[tuple[float, float | None]],
        ranks: Sequence[int] | None = None,
        by: str = "s",
    ) -> Trace:
        """[(t, cores or None), ...] of a CPU quota on `ranks` (None: all); `by` "s" or "step"."""
        ranks_t = tuple(ranks) if ranks is not None else None
        return cls(
            tuple(
                CpuShareChange(None if v is None else float(v), ranks=ranks_t, **_when(t, by))
                for t, v in pairs
            )
        )

    @classmethod
    def busy(
        cls, pairs: Iterable[tuple[float, int]], ranks: Sequence[int] | None = None, by: str = "s"
    ) -> Trace:
        """[(t, busy processes per rank), ...] on `ranks` (None: all)."""
        ranks_t = tuple(ranks) if ranks is not None else None
        return cls(tuple(BusyChange(int(v), ranks=ranks_t, **_when(t, by)) for t, v in pairs))

    @classmethod
    def flows(
        cls,
        pairs: Iterable[tuple[float, int]],
        ranks: Sequence[int] | None = None,
        direction: str = "both",
        by: str = "s",
    ) -> Trace:
        """[(t, competing TCP flows per rank link), ...] on `ranks` (None: all)."""
        ranks_t = tuple(ranks) if ranks is not None else None
        return cls(
            tuple(
                FlowChange(int(v), ranks=ranks_t, direction=direction, **_when(t, by))
                for t, v in pairs
            )
        )

    def __add__(self, other: Trace) -> Trace:
        return Trace(self.changes + other.changes)
