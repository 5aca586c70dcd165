"""The update thread: applies each parameter's optimizer update as soon as its slice is reduced.

Updates of step s use the hyper-parameters captured at the `step()` call that ended step s (so an
LR scheduler stepping right after `step()` does not leak into the step still in flight). The user's
optimizer keeps the state: a shallow copy of it steps detached aliases of the parameters (same
storage, their own `.grad`), so a user's `zero_grad()` never reaches a gradient handed to it.
"""

from __future__ import annotations

import bisect
import collections
import copy
import queue
from typing import Any

import torch

from autobyte.scheduler.events import SliceReduced, StepHyperParameters, Stop
from autobyte.scheduler.layout import Layout
from autobyte.scheduler.metrics import StepLog
from autobyte.scheduler.progress import Progress, SchedulerError


class _AliasState:
    """The optimizer's `state`, seen through detached aliases of the parameters."""

    __slots__ = ("_optimizer", "_param_of")

    def __init__(self, optimizer: torch.optim.Optimizer, param_of: dict[torch.Tensor, torch.Tensor]):
        self._optimizer = optimizer
        self._param_of = param_of

    def __getitem__(self, alias: torch.Tensor) -> dict:
        return self._optimizer.state[self._param_of[alias]]

    def __setitem__(self, alias: torch.Tensor, value: dict) -> None:
        self._optimizer.state[self._param_of[alias]] = value

    def __contains__(self, alias: torch.Tensor) -> bool:
        return self._param_of[alias] in self._optimizer.state

    def get(self, alias: torch.Tensor, default: Any = None) -> Any:
        return self._optimizer.state.get(self._param_of[alias], default)


class Updater:
    """Owns the update queue; `main()` is the update thread."""

    def __init__(self, layout: Layout, params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                 group_of: list[int], progress: Progress, steps: StepLog,
                 clip_grad_norm: float | None, clip_norm_type: float) -> None:
        self.layout = layout
        self.optimizer = optimizer
        self.group_of = group_of
        self.progress = progress
        self.steps = steps
        self.clip = clip_grad_norm
        self.clip_norm_type = clip_norm_type
        self.last_grad_norm: float | None = None
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.aliases = [p.detach() for p in params]
        worker = copy.copy(optimizer)
        worker.__dict__.pop("step", None)  # an LR scheduler's instance-level wrapper
        worker._optimizer_step_pre_hooks = collections.OrderedDict()
        worker._optimizer_step_post_hooks = collections.OrderedDict()
        worker.state = _AliasState(optimizer, dict(zip(self.aliases, params)))
        self._worker = worker
        self._worker_step = type(optimizer).step

    def main(self) -> None:
        try:
            with torch.no_grad():
                self._loop()
        except BaseException as error:
            self.progress.fail(error)

    def _loop(self) -> None:
        layout, progress = self.layout, self.progress
        n = layout.n
        offs, by_offset, ext = layout.sorted_offsets, layout.by_offset, layout.ext_len
        reduced = [0] * n
        ready: dict[int, list[int]] = {}
        snapshots: dict[int, list[dict]] = {}
        updated: dict[int, int] = {}
        clipping = self.clip is not None
        get, get_nowait = self.queue.get, self.queue.get_nowait
        empty = queue.Empty
        bisect_right = bisect.bisect_right
        while True:
            event = get()
            while True:
                kind = type(event)
                if kind is SliceReduced:
                    s, start, length, work, t_done = event
                    work.wait()  # no-op for gloo; orders the device stream for NCCL
                    end = start + length
                    pos = bisect_right(offs, start) - 1
                    while pos < n and offs[pos] < end:
                        i = by_offset[pos]
                        overlap = min(end, offs[pos] + ext[i]) - max(start, offs[pos])
                        reduced[i] += overlap
                        if reduced[i] == ext[i]:
                            reduced[i] = 0
                            ready.setdefault(s, []).append(i)
                        pos += 1
                    rec = self.steps.record(s)
                    if t_done > rec.t_last_done:
                        rec.t_last_done = t_done
                elif kind is StepHyperParameters:
                    snapshots[event.step] = event.groups
                elif kind is Stop:
                    return
                try:
                    event = get_nowait()
                except empty:
                    break
            for s in sorted(ready):
                if s not in snapshots:
                    continue
                if clipping and len(ready[s]) < n:
                    continue
                idxs = ready.pop(s)
                self._apply(s, idxs, snapshots[s])
                done = updated.get(s, 0) + len(idxs)
                with progress.cond:
                    step_number = s + 1
                    for i in idxs:
                        progress.param_step[i] = step_number
                    if done == n:
                        del snapshots[s]
                        updated.pop(s, None)
                        progress.updated_through = step_number
                        self.steps.completed.append(s)
                    else:
                        updated[s] = done
                    progress.cond.notify_all()

    def _apply(self, s: int, idxs: list[int], snapshot: list[dict]) -> None:
        """Apply step s's optimizer update to parameters whose gradients are reduced."""
        layout = self.layout
        flags = layout.flat[[layout.flag_index(i) for i in idxs]].tolist()
        used = [i for i, flag in zip(idxs, flags) if flag > 0]
        if self.clip is not None:
            views = [layout.grad_views[i] for i in used]
            if views:
                norms = torch._foreach_norm(views, self.clip_norm_type)
                total = torch.linalg.vector_norm(torch.stack(norms), self.clip_norm_type)
                coef = torch.clamp(self.clip / (total + 1e-6), max=1.0)
                torch._foreach_mul_(views, coef)
                self.last_grad_norm = float(total)
        by_group: dict[int, list[torch.Tensor]] = {}
        for i in used:
            g = self.group_of[i]
            if g < 0:
                continue
            alias = self.aliases[i]
            alias.grad = layout.grad_views[i]
            by_group.setdefault(g, []).append(alias)
        if not by_group:
            return
        if len(snapshot) != len(self.optimizer.param_groups):
            raise SchedulerError("the optimizer's param_groups changed after construction")
        worker = self._worker
        worker.param_groups = [dict(snapshot[g], params=aliases) for g, aliases in sorted(by_group.items())]
        try:
            self._worker_step(worker)
        finally:
            for aliases in by_group.values():
                for alias in aliases:
                    alias.grad = None
