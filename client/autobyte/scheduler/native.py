"""The native hot path's bridge: whether `autobyte._native` (native/engine.cpp) is built and can run
here and why not, and the dispatcher/updater that drive it behind the Python path's calls.

On the native path a C++ engine does the per-partition work without the GIL: rank 0's ready heap,
credit window, partition plans, decision frames and all-reduce launches on a C++ thread; on the
followers a C++ receiver and a C++ thread issuing rank 0's log in order; completion as a C++
callback on the work's future that returns the credit and hands only *whole parameters* to the
Python update thread, in batches. Python keeps the gradient hooks (one `grad_ready` call per
parameter), the optimizer updates, AMP/clipping, tracked reads and every guarantee of the package
docstring; the collective order is still rank 0's log (same frames, same slices, same order), so both
paths give bit-identical parameters.

The Python path runs instead (and `autobyte check-build` / the scheduler's log line say why) when
the extension is not built (then `autobyte.native_build` compiles it in the background for the
processes started after it) or not loadable, `AUTOBYTE_NATIVE=0` or `ScheduledOptimizer(native=False)`
asks for it, the parameters are on CUDA (the CUDA ordering of `device` is Python-only), the data
group's backend is not gloo, the decision channel fell back to gloo point-to-point, or another rank of
the data-parallel group cannot run it (the choice is collective).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from autobyte.native_status import MODULE, load, status
from autobyte.scheduler.dispatch import DispatchStats
from autobyte.scheduler.events import StepHyperParameters, Stop
from autobyte.scheduler.progress import SchedulerError
from autobyte.scheduler.update import Updater
from autobyte.types import Config, config_from_ints, config_to_ints

logger = logging.getLogger(__name__)


def _local_reason(wanted: bool, device: Any, backend: str | None, channel: Any) -> str:
    if not wanted:
        return "disabled by ScheduledOptimizer(native=False)"
    # not built: compiled in the background for later processes, where it could run
    state = status(start_build=device.type == "cpu" and backend == "gloo")
    if not state.active:
        return state.reason
    if device.type != "cpu":
        return (
            f"parameters on {device.type}: the native path runs CPU tensors on gloo; the CUDA "
            "ordering (streams, events, polled completion) is the Python path's"
        )
    if backend != "gloo":
        return (
            f"the data group's backend is {backend!r}: the native path issues gloo collectives only"
        )
    if channel is not None and channel.kind != "socket":
        return (
            "the decision channel is gloo point-to-point (AUTOBYTE_DECISION_CHANNEL=gloo or no "
            "socket to rank 0): the native path reads rank 0's decisions from the socket channel"
        )
    return ""


def choose_hot_path(
    wanted: bool, device: Any, backend: str | None, channel: Any, decision_group: Any, world: int
) -> tuple[Any, str]:
    """(the extension module or None, why not). Collective over the data-parallel group when
    world > 1: every rank takes the same path."""
    reason = _local_reason(wanted, device, backend, channel)
    if world > 1:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([0 if reason else 1], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=decision_group)
        if not reason and flag.item() == 0:
            reason = (
                "another rank of the data-parallel group cannot run the native path (see its log)"
            )
    return (None, reason) if reason else (load()[0], "")


_logged: set[tuple[bool, str]] = set()


def log_choice(native: bool, reason: str) -> None:
    """One INFO line per process and choice: which hot path runs, and why not the native one."""
    if (native, reason) in _logged:
        return
    _logged.add((native, reason))
    if native:
        logger.info(
            "autobyte scheduler: native hot path (%s, built for torch %s)",
            MODULE,
            status().built_for_torch,
        )
    else:
        logger.info("autobyte scheduler: Python hot path: %s", reason)


class NativeDispatcher:
    """The dispatch side on the native path: same calls as `dispatch.Dispatcher`."""

    def __init__(
        self,
        module: Any,
        layout: Any,
        group: Any,
        is_leader: bool,
        rank: int,
        steps: Any,
        channel: Any,
        timeout_s: float,
        trace: bool = False,
        sparse: Any = (),
    ) -> None:
        fds, fd = channel.detach_sockets() if channel is not None else ([], -1)
        self.engine = module.Engine(
            layout.flat,
            layout.sorted_offsets,
            layout.by_offset,
            layout.ext_len,
            group,
            is_leader,
            fds,
            fd,
            rank,
            trace,
            [e.start for e in sparse],
            [e.rows for e in sparse],
            [e.cols for e in sparse],
        )
        self.is_leader = is_leader
        self.steps = steps
        self.timeout_s = timeout_s
        self.closed = False
        self.grad_ready = self.engine.grad_ready  # (param, step): one C++ call per gradient

    def start(self, start_step: int, spawn: Callable[[str, Callable, tuple], None]) -> None:
        if self.is_leader:
            config, decision_id = self.steps.config_at(start_step)
            self.engine.start_leader(start_step, *config_to_ints(config), decision_id)
        else:
            self.engine.start_follower()

    def step_boundary(self, step: int, config: Config, decision_id: int) -> None:
        self.engine.step_boundary(step, *config_to_ints(config), decision_id)

    def drain(self, step: int) -> None:
        self.engine.drain(step)  # as Dispatcher.drain

    def stop(self, bound_s: float | None = None) -> None:
        self.closed = True
        if not self.engine.stop(min(self.timeout_s, 60.0) if bound_s is None else bound_s):
            logger.warning(
                "native scheduler threads did not stop in time (a follower still waiting "
                "for rank 0's stop message?); abandoned"
            )

    @property
    def stats(self) -> DispatchStats:
        raw = self.engine.stats()
        stats = DispatchStats()
        stats.parts, stats.sched_ns = raw["partitions"], raw["sched_ns"]
        stats.backend_ns, stats.backend_wall_ns = raw["backend_ns"], raw["backend_wall_ns"]
        stats.sparse_packed = raw["sparse_packed"]
        return stats

    def channel_stats(self) -> tuple[int, int, int, int]:
        raw = self.engine.stats()
        return raw["messages"], raw["send_ns"], raw["latency_ns"], raw["latency_n"]


class NativeUpdater(Updater):
    """The update thread on the native path: whole reduced parameters come from the engine."""

    def __init__(self, *args: Any, engine: Any, module: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine = engine
        self._kinds = (module.UP_REDUCED, module.UP_MARKER, module.UP_CONFIG, module.UP_ERROR)

    def post(self, event: Any) -> None:
        self.queue.put(event)
        self.engine.post_marker()

    def _receive(self) -> bool:
        reduced_kind, marker_kind, config_kind, error_kind = self._kinds
        ready, progress, notify_reduced = self._ready, self.progress, self._notify_reduced
        for event in self.engine.wait_updates():  # the GIL is released while it waits
            kind = event[0]
            if kind == reduced_kind:
                s, params = event[1], event[2]
                ready.setdefault(s, []).extend(params)
                self._count_reduced(s, len(params))
                handed_back = [i for i in params if notify_reduced[i]]
                if handed_back:
                    with progress.cond:
                        for i in handed_back:
                            progress.reduced_step[i] = s + 1
                        progress.cond.notify_all()
            elif kind == marker_kind:
                posted = self.queue.get_nowait()
                if type(posted) is Stop:
                    return False
                if type(posted) is StepHyperParameters:
                    self._snapshots[posted.step] = posted.groups
            elif kind == config_kind:
                _, step, partition_bytes, credit_bytes, tail_bytes, decision_id = event
                self.steps.log_config(
                    step, config_from_ints(partition_bytes, credit_bytes, tail_bytes), decision_id
                )
            elif kind == error_kind:
                raise SchedulerError(event[1])
        return True

    def _step_done(self, s: int) -> None:
        t_first_issue, nbytes, parts, queue_s, t_last_done = self.engine.take_step_stats(s)
        rec = self.steps.record(s)
        rec.t_first_issue, rec.bytes, rec.parts = t_first_issue, nbytes, parts
        rec.queue_s, rec.t_last_done = queue_s, t_last_done


def trace_requested() -> bool:
    """AUTOBYTE_TRACE_PARTITIONS=1: the engine keeps per-partition timestamps
    (benchmarks/profile_step.py reads them with `take_trace()`)."""
    return os.environ.get("AUTOBYTE_TRACE_PARTITIONS", "0") == "1"
