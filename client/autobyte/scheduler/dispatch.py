"""The dispatch threads: rank 0 decides the collective order under the credit window, followers
replay it. One dispatch thread per rank issues every collective of the data group.

Rank 0 (`leader_loop`) pops the highest-priority ready partition (earliest forward use; older steps
first) while in-flight bytes < `credit_bytes` (None = unlimited) -- or, in the tail window
(`Config.tail_bytes`: the newest step has at most that much gradient left to produce), only while
nothing is in flight -- publishes the decisions on the
decision channel *before* issuing them, and issues an async all-reduce for each. A step that a read
waits for in full (`drain`) sends each contiguous run of its ready partitions as one collective, and
what is left of it once all its gradients are produced at once, outside the credit window. A follower
(`follower_loop`) issues rank 0's triples strictly in log order, each once every parameter the slice
overlaps has produced its gradient of that step locally; `receiver_loop` feeds it from the channel.
"""

from __future__ import annotations

import collections
import datetime
import functools
import heapq
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from autobyte.scheduler import order_channel
from autobyte.scheduler.device import DeviceSync
from autobyte.scheduler.events import (
    CreditBack,
    DecisionsReceived,
    Drain,
    GradReady,
    Issue,
    SliceReduced,
    StepBoundary,
    Stop,
)
from autobyte.scheduler.layout import Layout
from autobyte.scheduler.metrics import StepLog
from autobyte.scheduler.order_channel import OrderChannel, cpu_ns
from autobyte.scheduler.progress import Progress, SchedulerError
from autobyte.scheduler.sparse_rows import SparseRows
from autobyte.types import Config

# How long the completion thread waits on one collective before it looks at `closed` again.
COMPLETION_POLL = datetime.timedelta(milliseconds=50)


def _outcome_after_timeout(work: Any) -> RuntimeError | None:
    """A wait that raised and a work completed by the time it is asked: the wait may have timed
    out ("Operation timed out!") a moment before the collective completed, which is no failure.
    The work's own outcome, from a second wait (at once, it is complete): its error, or None."""
    try:
        work.wait(COMPLETION_POLL)
    except RuntimeError as outcome:
        return outcome
    return None


class DispatchStats:
    """The scheduler's own cost apart from the backend's launch calls (CPU ns)."""

    __slots__ = ("backend_ns", "backend_wall_ns", "parts", "sched_ns", "sparse_packed")

    def __init__(self) -> None:
        self.parts = 0
        self.sparse_packed = 0  # row-sparse reductions sent packed (sparse_rows)
        self.sched_ns = 0
        self.backend_ns = 0
        self.backend_wall_ns = 0


def _draining(plans: dict, entry: tuple) -> bool:
    """The ready slice `entry` (step, -start, length, t_ready) belongs to a step a read waits for
    in full, and every gradient of that step is produced: it goes out now (Dispatcher.drain)."""
    plan = plans[entry[0]]
    return plan.drain and plan.unready == 0


class Dispatcher:
    """Owns the comm queue and the issue of collectives on the data group."""

    def __init__(
        self,
        layout: Layout,
        group: Any,
        is_leader: bool,
        followers: bool,
        progress: Progress,
        steps: StepLog,
        channel: OrderChannel | None,
        update_q: queue.SimpleQueue,
        device_sync: DeviceSync | None = None,
        sparse: Sequence[SparseRows] = (),
    ) -> None:
        self.layout = layout
        self.sparse = {entry.start: entry for entry in sparse}  # row-sparse weights by slice start
        self.group = group
        self.is_leader = is_leader
        self.followers = followers
        self.progress = progress
        self.steps = steps
        self.channel = channel
        self.update_q = update_q
        self.device_sync = device_sync if device_sync is not None else DeviceSync()
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.stats = DispatchStats()
        self.closed = False  # set by the optimizer when it closes (the receiver then ends quietly)
        # CPU: collectives in flight, oldest first, for the completion thread (`completion_main`)
        self._inflight: collections.deque = collections.deque()
        self._inflight_cond = threading.Condition()

    # ------------------------------------------------------------------ the optimizer's calls

    def start(self, start_step: int, spawn: Callable[[str, Callable, tuple], None]) -> None:
        """Start the dispatch threads (`spawn(name, target, args)` starts a Python thread)."""
        if self.is_leader:
            spawn("leader", self.leader_main, (start_step,))
        else:
            spawn("follower", self.follower_main, ())
            spawn("receiver", self.receiver_main, ())
        if not self.device_sync.cuda:
            spawn("completion", self.completion_main, ())

    def grad_ready(self, param: int, step: int) -> None:
        """Training thread: a parameter's gradient of `step` is in the flat buffer."""
        self.queue.put(GradReady(param, step))

    def step_boundary(self, step: int, config: Config, decision_id: int) -> None:
        """Rank 0's step(): the plan of `step` uses `config`."""
        self.queue.put(StepBoundary(step, config, decision_id))

    def drain(self, step: int) -> None:
        """Rank 0: a read waits for every gradient of `step` (the loop reads between backward and
        step: a clip, a norm logged), so no order among its partitions lets the next forward start
        sooner; only the count of collectives costs. Each contiguous run of its ready partitions
        goes out as one collective when the credit window opens (a row-sparse weight's apart), and
        once the step's gradients are all produced, what is left of it goes out at once: the
        per-collective cost is paid once per run, as DDP pays it once per bucket."""
        self.queue.put(Drain(step))

    def stop(self, bound_s: float | None = None) -> None:
        """close(): the dispatch threads end (a follower's when rank 0's stop message arrives);
        never blocks (`bound_s` is the native engine's)."""
        self.closed = True
        self.queue.put(Stop())
        with self._inflight_cond:
            self._inflight_cond.notify_all()

    def channel_stats(self) -> tuple[int, int, int, int]:
        """(messages, send ns, latency ns, latency samples) of the decision channel."""
        channel = self.channel
        if channel is None:
            return 0, 0, 0, 0
        return channel.messages, channel.send_ns, channel.latency_ns, channel.latency_n

    # ------------------------------------------------------------------ issue and completion

    def _issue(self, s: int, start: int, length: int, t_ready: float) -> int:
        """Launch one all-reduce; returns the backend launch time in CPU ns."""
        sync = self.device_sync
        if sync.cuda:  # the collective after the gradient copies it reads
            layout = self.layout
            first, last = layout.params_in(start, length)
            sync.before_issue(layout.by_offset[first : last + 1])
        c0, t0 = cpu_ns(), time.perf_counter_ns()
        nbytes, unpack = length * self.layout.elem, None
        sparse = self.sparse.get(start) if self.sparse else None
        if sparse is not None and sparse.active and sparse.length == length:
            packed = sparse.reduce(
                self.layout.flat, self.group
            )  # rank 0's order: same on every rank
            if packed is None:
                nbytes += sparse.rows  # the mask; the whole slice follows
            else:
                work, unpack, nbytes = packed
                self.stats.sparse_packed += 1
        if unpack is None:
            work = dist.all_reduce(
                self.layout.flat[start : start + length], group=self.group, async_op=True
            )
        t1, c1 = time.perf_counter_ns(), cpu_ns()
        self.stats.backend_wall_ns += t1 - t0
        if sync.cuda:  # NCCL completes its future at enqueue: poll the work instead
            sync.watch(work, functools.partial(self._on_done, s, start, length, work))
        else:
            with self._inflight_cond:
                self._inflight.append((s, start, length, work, unpack))
                self._inflight_cond.notify()
        rec = self.steps.record(s)
        now = time.perf_counter()
        if rec.t_first_issue is None:
            rec.t_first_issue = now
        rec.bytes += nbytes
        rec.parts += 1
        rec.queue_s += max(0.0, now - t_ready)
        self.stats.parts += 1
        return c1 - c0

    def completion_main(self) -> None:
        """CPU: the completion thread. It waits on each collective in flight, oldest first, and
        hands it on as reduced. Not a callback on the work's future: a Python callback still
        attached when the interpreter shuts down (a peer gone mid-step, a Ctrl-C) is released by
        the backend's thread once the work fails, which then needs the GIL of a finalizing
        interpreter and aborts the process ("terminate called after throwing an instance of
        'gloo::IoException'"). A collective left in flight here holds no Python object, as DDP's
        do not; this thread ends within `COMPLETION_POLL` of `stop()`."""
        try:
            with torch.no_grad():
                self._completion_loop()
        except BaseException as error:  # noqa: BLE001 - surfaced at the next step()/synchronize()
            self.progress.fail(error)

    def _completion_loop(self) -> None:
        inflight, cond = self._inflight, self._inflight_cond
        while True:
            with cond:
                while not inflight and not self.closed:
                    cond.wait()
                if not inflight:
                    return
                s, start, length, work, unpack = inflight[0]
            try:
                work.wait(COMPLETION_POLL)
            except RuntimeError:
                if not work.is_completed():  # "Operation timed out!": still in flight
                    if self.closed:
                        return  # left to the backend, with nothing of Python attached
                    continue
                failure = _outcome_after_timeout(work)
                if failure is not None:
                    inflight.popleft()
                    self.progress.fail(failure)
                    continue
            inflight.popleft()
            if unpack is not None:
                try:
                    unpack()  # a row-sparse weight's packed rows back into the flat buffer
                except BaseException as error:  # noqa: BLE001 - surfaced at the next step()
                    self.progress.fail(error)
                    continue
            self._on_done(s, start, length, work, None)

    def _on_done(
        self, s: int, start: int, length: int, work: Any, error: BaseException | None
    ) -> None:
        if error is not None:
            self.progress.fail(error)
            return
        t_done = time.perf_counter()
        if self.is_leader:
            self.queue.put(CreditBack(length * self.layout.elem))
        self.update_q.put(SliceReduced(s, start, length, work, t_done))

    # ------------------------------------------------------------------ rank 0

    def leader_main(self, start_step: int) -> None:
        try:
            with torch.no_grad(), self.device_sync.issue_context():
                self._leader_loop(start_step)
        except BaseException as error:  # noqa: BLE001 - surfaced at the next step()/synchronize()
            self.progress.fail(error)

    def _leader_loop(self, start_step: int) -> None:
        layout, channel, followers, stats = self.layout, self.channel, self.followers, self.stats
        config, decision_id = self.steps.config_at(start_step)
        plans = {start_step: layout.plan(config.partition_bytes, config.tail_bytes)}
        credit = config.credit_bytes
        in_tail = (
            False  # the newest step's backward is in its tail window: one collective at a time
        )
        ext_len = layout.ext_len
        if followers:
            channel.send(order_channel.config_message(start_step, config, decision_id))
        heap: list = []
        push, pop = heapq.heappush, heapq.heappop
        inflight = 0
        elem = layout.elem
        sparse = self.sparse or None  # row-sparse weights' slices: never part of a merged run
        get, get_nowait = self.queue.get, self.queue.get_nowait
        perf = time.perf_counter
        empty = queue.Empty
        while True:
            event = get()
            t0 = cpu_ns()
            backend_ns = 0
            while True:
                kind = type(event)
                if kind is GradReady:
                    plan = plans[event.step]
                    remaining = plan.remaining
                    plan.unready -= ext_len[event.param]
                    in_tail = 0 < plan.unready <= plan.tail
                    for k in plan.param_parts[event.param]:
                        remaining[k] -= 1
                        if remaining[k] == 0:
                            start, length = plan.parts[k]
                            push(heap, (event.step, -start, length, perf()))
                elif kind is CreditBack:
                    inflight -= event.nbytes
                elif kind is Drain:
                    plan = plans.get(event.step)
                    if plan is not None:
                        plan.drain = True
                elif kind is StepBoundary:
                    step, new_config, new_id = event
                    plans[step] = layout.plan(new_config.partition_bytes, new_config.tail_bytes)
                    if (new_config, new_id) != (config, decision_id) and followers:
                        backend_ns += channel.send(
                            order_channel.config_message(step, new_config, new_id)
                        )
                    config, decision_id, credit = new_config, new_id, new_config.credit_bytes
                elif kind is Stop:
                    if followers:
                        channel.send_stop()
                    return
                try:
                    event = get_nowait()
                except empty:
                    break
            window = 1 if in_tail else credit
            if heap and (window is None or inflight < window or _draining(plans, heap[0])):
                batch = []
                while heap and (window is None or inflight < window or _draining(plans, heap[0])):
                    step, neg_start, length, t_ready = pop(heap)
                    start, runs = -neg_start, 1
                    if plans[step].drain and (sparse is None or start not in sparse):
                        while heap and heap[0][0] == step:
                            _, below, n, t = heap[0]
                            if -below + n != start or (sparse is not None and -below in sparse):
                                break
                            pop(heap)
                            start, length, runs = -below, length + n, runs + 1
                            t_ready = min(t_ready, t)
                    batch.append((step, start, length, t_ready, runs))
                    inflight += length * elem
                if followers:
                    backend_ns += channel.send_order([(s, a, n) for s, a, n, _, _ in batch])
                for step, start, length, t_ready, runs in batch:
                    backend_ns += self._issue(step, start, length, t_ready)
                    plan = plans[step]
                    plan.left -= runs
                    if plan.left == 0:
                        del plans[step]
            stats.sched_ns += cpu_ns() - t0 - backend_ns
            stats.backend_ns += backend_ns

    # ------------------------------------------------------------------ followers

    def receiver_main(self) -> None:
        """Follower: receive rank 0's decision stream (the only user of the decision group here)."""
        try:
            channel, layout = self.channel, self.layout
            while True:
                message = channel.receive()
                kind = message[0]
                if kind == order_channel.MSG_ORDER:
                    entries = []
                    header = order_channel.MSG_HEADER
                    for k in range(message[1]):
                        step, start, length = message[header + 3 * k : header + 3 * k + 3]
                        first, last = layout.params_in(start, length)
                        entries.append(Issue(step, start, length, first, last))
                    self.queue.put(DecisionsReceived(entries))
                elif kind == order_channel.MSG_CONFIG:
                    self.steps.log_config(message[1], order_channel.config_of(message), message[3])
                elif kind == order_channel.MSG_STOP:
                    self.queue.put(Stop())
                    channel.close_receiver()
                    return
                else:
                    raise SchedulerError(f"unknown decision message kind {kind}")
        except BaseException as error:  # noqa: BLE001 - surfaced at the next step()/synchronize()
            if not self.closed:
                self.progress.fail(
                    SchedulerError(str(error)) if isinstance(error, ConnectionError) else error
                )

    def follower_main(self) -> None:
        try:
            with torch.no_grad(), self.device_sync.issue_context():
                self._follower_loop()
        except BaseException as error:  # noqa: BLE001 - surfaced at the next step()/synchronize()
            self.progress.fail(error)

    def _follower_loop(self) -> None:
        pending: collections.deque[Issue] = collections.deque()
        progress, stats = self.progress, self.stats
        produced, produced_t, by_offset = (
            progress.produced,
            progress.produced_t,
            self.layout.by_offset,
        )
        get, get_nowait = self.queue.get, self.queue.get_nowait
        empty = queue.Empty
        cursor = -1  # first position of the head entry not yet known to be ready
        stopping = False
        while True:
            event = get()
            t0 = cpu_ns()
            while True:
                kind = type(event)
                if kind is DecisionsReceived:
                    pending.extend(event.entries)
                elif kind is Stop:
                    stopping = True
                try:
                    event = get_nowait()
                except empty:
                    break
            backend_ns = 0
            while pending:
                step, start, length, first, last = pending[0]
                pos = max(first, cursor)
                while pos <= last and produced[by_offset[pos]] >= step:
                    pos += 1
                if pos <= last:
                    cursor = pos
                    break
                cursor = -1
                pending.popleft()
                t_ready = max(produced_t[by_offset[q]] for q in range(first, last + 1))
                backend_ns += self._issue(step, start, length, t_ready)
            stats.sched_ns += cpu_ns() - t0 - backend_ns
            stats.backend_ns += backend_ns
            if stopping:
                return
