"""Where a scheduled step's time goes, derived from its timestamps (pure functions, no torch).

`benchmarks/profile_step.py` records, per step, the training thread's marks (forward, backward,
`step()`), every wait of the forward pass for parameters, every partition's ready / issue / done
(the native engine's trace) and every thread's CPU time; these functions turn them into the
breakdown `benchmarks.profile_step` prints. Times are seconds on one
clock (time.perf_counter), sizes bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import statistics
import threading
from collections.abc import Iterable, Sequence
from typing import NamedTuple


class Transfer(NamedTuple):
    """One collective of a step, as an engine traced it (or both ranks' traces merged)."""

    step: int
    start: int  # offset in the flat gradient buffer (elements): higher = needed earlier in forward
    length: int  # elements
    nbytes: int
    t_ready: float  # every gradient it covers was produced
    t_issue: float  # the launch call returned
    t_done: float  # the backend reported it complete


class Wait(NamedTuple):
    """The training thread stood still for parameters of `step` (its forward pass)."""

    step: int
    t_begin: float
    t_end: float


class StepMarks(NamedTuple):
    """The training thread's marks of one step."""

    step: int
    t_start: float  # before zero_grad / forward
    t_forward_end: float  # the loss is computed
    t_backward_end: float  # backward() returned
    t_end: float  # step() returned


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of closed intervals as disjoint sorted intervals (empty ones dropped)."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if merged and a <= merged[-1][1]:
            if b > merged[-1][1]:
                merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by at least one interval."""
    return sum(b - a for a, b in merge(intervals))


@dataclasses.dataclass(frozen=True)
class LinkStep:
    """The link's view of step n's gradients: cycle_s = busy_s + idle_inside_s + boundary_stall_s
    (first issue of step n to first issue of step n+1, which is the step time in steady state)."""

    step: int
    collectives: int
    nbytes: int
    busy_s: float  # some collective of step n in flight (union of issue..done)
    idle_inside_s: float  # between step n's first issue and last completion, nothing in flight
    boundary_stall_s: float  # last completion of n to first issue of n+1 (< 0: they overlap)
    cycle_s: float
    stall_in_forward_s: float = 0.0  # the part of the stall while step n+1's forward ran
    stall_in_backward_s: float = 0.0  # ... while its backward ran (before its first issue)


def merge_ranks(rank0: Sequence[Transfer], rank1: Sequence[Transfer]) -> list[Transfer]:
    """Both ranks' traces of the same collectives (matched by step and slice; one clock on one
    host): a 2-rank all-reduce moves once both ranks have issued it, so the merged one is ready
    and issued at the later rank's time and done at the later completion. Unmatched are dropped."""
    other = {(t.step, t.start, t.length): t for t in rank1}
    merged = []
    for t in rank0:
        u = other.get((t.step, t.start, t.length))
        if u is not None:
            merged.append(
                t._replace(
                    t_ready=max(t.t_ready, u.t_ready),
                    t_issue=max(t.t_issue, u.t_issue),
                    t_done=max(t.t_done, u.t_done),
                )
            )
    return merged


def issue_skew(rank0: Sequence[Transfer], rank1: Sequence[Transfer]) -> list[float]:
    """Rank 1's issue minus rank 0's, per matched collective (> 0: the follower was later)."""
    first = {(t.step, t.start, t.length): t.t_issue for t in rank0}
    return [t.t_issue - first[k] for t in rank1 if (k := (t.step, t.start, t.length)) in first]


def last_ready_skew(rank0: Sequence[Transfer], rank1: Sequence[Transfer]) -> list[float]:
    """Per step, rank 1's last gradient ready minus rank 0's (> 0: rank 1's backward ended later);
    a collective moves only once both ranks have it, so this is how long rank 0 waits for rank 1."""

    def last(transfers: Sequence[Transfer]) -> dict[int, float]:
        out: dict[int, float] = {}
        for t in transfers:
            out[t.step] = max(out.get(t.step, t.t_ready), t.t_ready)
        return out

    a, b = last(rank0), last(rank1)
    return [b[s] - a[s] for s in sorted(a) if s in b]


def overlap(a: float, b: float, c: float, d: float) -> float:
    """Length of [a, b] ∩ [c, d]."""
    return max(0.0, min(b, d) - max(a, c))


def link_steps(transfers: Sequence[Transfer], marks: Sequence[StepMarks] = ()) -> list[LinkStep]:
    """One LinkStep per step that has transfers and a next step with transfers; with the training
    marks, the boundary stall is split by what the training thread of step n+1 was doing."""
    mark_of = {m.step: m for m in marks}
    by_step: dict[int, list[Transfer]] = {}
    for t in transfers:
        by_step.setdefault(t.step, []).append(t)
    out = []
    for s in sorted(by_step):
        nxt = by_step.get(s + 1)
        if not nxt:
            continue
        own = by_step[s]
        first_issue = min(t.t_issue for t in own)
        last_done = max(t.t_done for t in own)
        next_issue = min(t.t_issue for t in nxt)
        busy = union_length((t.t_issue, t.t_done) for t in own)
        in_forward = in_backward = 0.0
        m = mark_of.get(s + 1)
        if m is not None:
            in_forward = overlap(last_done, next_issue, m.t_start, m.t_forward_end)
            in_backward = overlap(last_done, next_issue, m.t_forward_end, m.t_backward_end)
        out.append(
            LinkStep(
                step=s,
                collectives=len(own),
                nbytes=sum(t.nbytes for t in own),
                busy_s=busy,
                idle_inside_s=(last_done - first_issue) - busy,
                boundary_stall_s=next_issue - last_done,
                cycle_s=next_issue - first_issue,
                stall_in_forward_s=in_forward,
                stall_in_backward_s=in_backward,
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class FirstPartitions:
    """Step n's partitions that step n+1's forward needs first (those overlapping the first
    parameter's slice, which sits at the top of the buffer), and how long that forward stood still
    at its start."""

    step: int
    ready_to_issue_s: float  # the latest of them: queued behind the credit window
    issue_to_done_s: float  # the latest of them: in flight (includes queueing inside the backend)
    done_after_backward_s: float  # their last completion after step n's backward() returned
    next_first_wait_s: float  # step n+1's first wait, if it began before the forward's first 10%
    next_forward_wait_s: float  # every wait of step n+1


def first_partitions(
    transfers: Sequence[Transfer],
    first_start: int,
    marks: Sequence[StepMarks],
    waits: Sequence[Wait],
) -> list[FirstPartitions]:
    """Per step n with marks of n and n+1 and transfers of n reaching above `first_start`."""
    mark_of = {m.step: m for m in marks}
    waits_of: dict[int, list[Wait]] = {}
    for w in waits:
        waits_of.setdefault(w.step, []).append(w)
    out = []
    for s in sorted(mark_of):
        nxt = mark_of.get(s + 1)
        firsts = [t for t in transfers if t.step == s and t.start + t.length > first_start]
        if nxt is None or not firsts:
            continue
        last = max(firsts, key=lambda t: t.t_done)
        queued = max(t.t_issue - t.t_ready for t in firsts)
        next_waits = sorted(waits_of.get(s + 1, []))
        forward_s = max(1e-9, nxt.t_forward_end - nxt.t_start)
        first_wait = 0.0
        if next_waits and next_waits[0].t_begin - nxt.t_start <= 0.1 * forward_s:
            first_wait = next_waits[0].t_end - next_waits[0].t_begin
        out.append(
            FirstPartitions(
                step=s,
                ready_to_issue_s=queued,
                issue_to_done_s=last.t_done - last.t_issue,
                done_after_backward_s=last.t_done - mark_of[s].t_backward_end,
                next_first_wait_s=first_wait,
                next_forward_wait_s=sum(w.t_end - w.t_begin for w in next_waits),
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class TrainingStep:
    """The training thread's step n: step_s = forward_s + forward_wait_s + backward_s + step_call_s
    + between_s (from its start to step n+1's start)."""

    step: int
    step_s: float
    forward_s: float  # forward compute, waits excluded
    forward_wait_s: float
    backward_s: float
    step_call_s: float  # optimizer.step() (DDP: the update; the scheduler: hand-off only)
    between_s: float  # after step() until the next step starts (zero_grad, the loop)


def training_steps(marks: Sequence[StepMarks], waits: Sequence[Wait] = ()) -> list[TrainingStep]:
    """One TrainingStep per mark that has a next one; waits are attributed by their time."""
    ordered = sorted(marks)
    out = []
    for m, nxt in itertools.pairwise(ordered):
        fwd_wait = union_length(
            (max(w.t_begin, m.t_start), min(w.t_end, m.t_forward_end)) for w in waits
        )
        out.append(
            TrainingStep(
                step=m.step,
                step_s=nxt.t_start - m.t_start,
                forward_s=m.t_forward_end - m.t_start - fwd_wait,
                forward_wait_s=fwd_wait,
                backward_s=m.t_backward_end - m.t_forward_end,
                step_call_s=m.t_end - m.t_backward_end,
                between_s=nxt.t_start - m.t_end,
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class RankPace:
    """How far apart the ranks' compute runs, step by step. A step's compute is its forward
    without the waits for parameters plus its backward; both ranks leave those waits together
    (the same collectives complete), so the later rank's compute paces the next collectives."""

    steps: int  # steps both ranks measured
    compute_s: tuple[float, float]  # mean compute per step, rank 0 and rank 1
    spread_s: tuple[float, float]  # each rank's standard deviation over its steps
    apart_s: float  # mean |rank 1 - rank 0| of the same step
    independent_s: (
        float  # what `apart_s` would be for two independent normal ranks with those spreads
    )

    @property
    def pace_cost_s(self) -> float:
        """Mean max(r0, r1) - mean (r0 + r1) / 2 = apart_s / 2: the wait for the later rank."""
        return self.apart_s / 2


def rank_pace(rank0: Sequence[TrainingStep], rank1: Sequence[TrainingStep]) -> RankPace | None:
    """The ranks' per-step compute side by side (None with fewer than two common steps).
    `independent_s` = sqrt((sd0^2 + sd1^2) * 2 / pi), the mean |difference| of two independent
    normal variables: where `apart_s` is about that, the skew is each rank's own jitter."""
    one = {r.step: r.forward_s + r.backward_s for r in rank1}
    pairs = [(r.forward_s + r.backward_s, one[r.step]) for r in rank0 if r.step in one]
    if len(pairs) < 2:
        return None
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    sd = (statistics.stdev(a), statistics.stdev(b))
    apart = statistics.fmean(abs(y - x) for x, y in pairs)
    return RankPace(
        steps=len(pairs),
        compute_s=(statistics.fmean(a), statistics.fmean(b)),
        spread_s=sd,
        apart_s=apart,
        independent_s=((sd[0] ** 2 + sd[1] ** 2) * 2 / math.pi) ** 0.5,
    )


def thread_kind(name: str) -> str:
    """Which part of the rank a thread is: training, update, dispatch (scheduler) or backend."""
    if name == "MainThread":
        return "training"
    if name.startswith("autobyte-") and name.endswith("-update"):
        return "update"
    if name.startswith(("autobyte-", "ab-r")):  # Python threads; the native engine's (ab-r0-leader)
        return "dispatch"
    return "backend"


class ThreadTimes(NamedTuple):
    """One thread's counters from /proc/<pid>/task/<tid>/schedstat."""

    name: str
    cpu_ns: int  # on a CPU
    runqueue_ns: int  # runnable but waiting for a CPU (competing with other threads/processes)


def thread_times() -> dict[int, ThreadTimes]:
    """Every thread of this process (Python names where Python made it, else the OS name)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid_text in os.listdir("/proc/self/task"):
        tid = int(tid_text)
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                cpu_ns, runqueue_ns = (int(x) for x in f.read().split()[:2])
            name = names.get(tid)
            if name is None:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[tid] = ThreadTimes(name, cpu_ns, runqueue_ns)
    return out


def time_by_kind(
    before: dict[int, ThreadTimes], after: dict[int, ThreadTimes], steps: int, field: str = "cpu_ns"
) -> dict[str, float]:
    """Seconds per step of `field` for each thread kind between two snapshots {tid: ThreadTimes};
    threads born in between count from zero."""
    out = {"training": 0.0, "update": 0.0, "dispatch": 0.0, "backend": 0.0}
    for tid, now in after.items():
        then = before.get(tid)
        base = getattr(then, field) if then is not None and then.name == now.name else 0
        out[thread_kind(now.name)] += (getattr(now, field) - base) * 1e-9 / max(1, steps)
    out["total"] = sum(out.values())
    return out


def median_of(rows: Sequence[object], field: str) -> float:
    """Median of a dataclass field over rows (0.0 for none)."""
    values = [getattr(r, field) for r in rows]
    return statistics.median(values) if values else 0.0
