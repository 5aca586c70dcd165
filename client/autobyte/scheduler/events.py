"""Named records that cross the scheduler's threads (training, dispatch, receiver, update)."""

from __future__ import annotations

from typing import Any, NamedTuple

from autobyte.types import Config

# ---- on a dispatch thread's queue


class GradReady(NamedTuple):
    """A parameter's gradient of `step` is in the flat buffer (training/autograd thread)."""

    param: int
    step: int


class CreditBack(NamedTuple):
    """An all-reduce of `nbytes` finished: its credit returns (rank 0's dispatch thread)."""

    nbytes: int


class StepBoundary(NamedTuple):
    """Rank 0's `step()` ended step `step - 1`: the plan of `step` uses `config`."""

    step: int
    config: Config
    decision_id: int


class Drain(NamedTuple):
    """Rank 0: a read of step `step`'s gradients waits for all of them (the loop reads between
    backward and step): its ready partitions go out as one collective per contiguous run
    (`Dispatcher.drain`)."""

    step: int


class Issue(NamedTuple):
    """One collective of rank 0's decision log: reduce flat[start:start+length] of `step`.
    `first`/`last` are the layout positions of the parameters the slice overlaps (followers)."""

    step: int
    start: int
    length: int
    first: int = 0
    last: int = -1


class DecisionsReceived(NamedTuple):
    """A batch of rank 0's decisions, received by a follower, in log order."""

    entries: list[Issue]


class Stop(NamedTuple):
    """Sentinel: the thread ends."""


# ---- on the update thread's queue


class SliceReduced(NamedTuple):
    """flat[start:start+length] of `step` is reduced (the backend's completion thread)."""

    step: int
    start: int
    length: int
    work: Any
    t_done: float


class StepHyperParameters(NamedTuple):
    """The optimizer's param-group hyper-parameters captured at the `step()` that ended `step`;
    None for a step a second synchronising backward ended (no update: its gradients carry on)."""

    step: int
    groups: list[dict] | None
