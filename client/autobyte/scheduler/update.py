"""The update thread: applies each parameter's optimizer update as soon as its slice is reduced.

Updates of step s use the hyper-parameters captured at the `step()` call that ended step s (so an
LR scheduler stepping right after `step()` does not leak into the step still in flight); a step
ended by a second synchronising backward instead has none, and no update: its reduced gradients
carry into the next step (`ScheduledOptimizer._carry_over`). The user's
optimizers keep the state: a shallow copy of each steps detached aliases of its parameters (same
storage, their own `.grad`), so a user's `zero_grad()` never reaches a gradient handed to it.

A step waits for *all* of its slices before any update when the update needs every gradient: global-
norm clipping (`clip_grad_norm=`) and loss scaling (`grad_scaler=`: unscale, skip the whole step on
inf/NaN — identically on every rank, since every rank sees the same reduced gradients — and update
the scale, exactly as `torch.amp.GradScaler` does after DDP's backward).
"""

from __future__ import annotations

import bisect
import collections
import copy
import queue
from collections.abc import Sequence
from typing import Any

import torch

from autobyte.scheduler.clipping import clip_in_parameter_order
from autobyte.scheduler.device import DeviceSync
from autobyte.scheduler.events import SliceReduced, StepHyperParameters, Stop
from autobyte.scheduler.layout import Layout
from autobyte.scheduler.metrics import StepLog
from autobyte.scheduler.progress import Progress, SchedulerError


def unscale(scale: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """GradScaler's unscale_ of `grads` in place (multiplied by 1/scale, as it computes it); returns
    found_inf (1.0 if any is inf/NaN)."""
    inv_scale = scale.double().reciprocal().float()
    found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
    if grads:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    return found_inf


class _AliasState:
    """An optimizer's `state`, seen through detached aliases of the parameters."""

    __slots__ = ("_optimizer", "_param_of")

    def __init__(
        self, optimizer: torch.optim.Optimizer, param_of: dict[torch.Tensor, torch.Tensor]
    ):
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


def _worker(
    optimizer: torch.optim.Optimizer, aliases: list[torch.Tensor], params: list[torch.Tensor]
) -> torch.optim.Optimizer:
    worker = copy.copy(optimizer)
    worker.__dict__.pop("step", None)  # an LR scheduler's instance-level wrapper
    worker._optimizer_step_pre_hooks = collections.OrderedDict()
    worker._optimizer_step_post_hooks = collections.OrderedDict()
    worker.state = _AliasState(optimizer, dict(zip(aliases, params)))
    return worker


class Updater:
    """Owns the update queue; `main()` is the update thread.

    `owner[i]` is (optimizer index, param-group index) of parameter i, or None for a parameter no
    wrapped optimizer holds (its averaged gradient is handed to `.grad` instead).
    """

    def __init__(
        self,
        layout: Layout,
        params: list[torch.Tensor],
        optimizers: Sequence[torch.optim.Optimizer],
        owner: list[tuple[int, int] | None],
        progress: Progress,
        steps: StepLog,
        clip_grad_norm: float | None,
        clip_norm_type: float,
        scaler: Any,
        local_used: list[int],
        device_sync: DeviceSync,
    ) -> None:
        self.layout = layout
        self.optimizers = list(optimizers)
        self.owner = owner
        self.progress = progress
        self.steps = steps
        self.clip = clip_grad_norm
        self.clip_norm_type = clip_norm_type
        self.scaler = scaler
        self.local_used = local_used
        self.device_sync = device_sync
        self.last_grad_norm: torch.Tensor | None = None
        self.skipped_steps = 0
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.aliases = [p.detach() for p in params]
        self._workers = [_worker(opt, self.aliases, params) for opt in self.optimizers]
        self._steps_of = [type(opt).step for opt in self.optimizers]
        self._notify_reduced = [own is None for own in owner]
        # dropped[i] == s: parameter i's gradient of step s was set to None before step() (a
        # read, `grad_reads`): its update is skipped, as an optimizer skips a None gradient
        self.dropped = [-1] * layout.n
        # step -> found_inf of a `scaler.unscale_(opt)` the loop called before step() (amp.py)
        self.unscaled: dict[int, torch.Tensor] = {}
        self._reduced_n: dict[int, int] = {}  # step -> parameters whose slices are all reduced

    def _count_reduced(self, s: int, count: int) -> None:
        """`count` more parameters of step s are reduced; the whole step wakes readers of `.grad`."""
        total = self._reduced_n.get(s, 0) + count
        if total < self.layout.n:
            self._reduced_n[s] = total
            return
        self._reduced_n.pop(s, None)
        progress = self.progress
        with progress.cond:
            progress.reduced_through = max(progress.reduced_through, s + 1)
            progress.cond.notify_all()

    def post(self, event: Any) -> None:
        """Hand the update thread a StepHyperParameters or Stop (training thread)."""
        self.queue.put(event)

    def main(self) -> None:
        try:
            with torch.no_grad(), self.device_sync.update_context():
                self._loop()
        except BaseException as error:  # noqa: BLE001 - surfaced at the next step()/synchronize()
            self.progress.fail(error)

    def _loop(self) -> None:
        self._ready: dict[int, list[int]] = {}
        self._snapshots: dict[int, list[list[dict]]] = {}
        self._updated: dict[int, int] = {}
        self._reduced = [0] * self.layout.n
        while self._receive():
            self._apply_ready()

    def _receive(self) -> bool:
        """Wait for events and take every one queued: reduced slices (a parameter whose whole slice
        is reduced becomes ready), hyper-parameters. False on Stop."""
        layout, progress = self.layout, self.progress
        n = layout.n
        offs, by_offset, ext = layout.sorted_offsets, layout.by_offset, layout.ext_len
        reduced, ready = self._reduced, self._ready
        notify_reduced = self._notify_reduced
        get, get_nowait = self.queue.get, self.queue.get_nowait
        empty = queue.Empty
        bisect_right = bisect.bisect_right
        event = get()
        while True:
            kind = type(event)
            if kind is SliceReduced:
                s, start, length, work, t_done = event
                work.wait()  # no-op for gloo; orders this thread's stream after NCCL's
                end = start + length
                pos = bisect_right(offs, start) - 1
                while pos < n and offs[pos] < end:
                    i = by_offset[pos]
                    overlap = min(end, offs[pos] + ext[i]) - max(start, offs[pos])
                    reduced[i] += overlap
                    if reduced[i] == ext[i]:
                        reduced[i] = 0
                        ready.setdefault(s, []).append(i)
                        self._count_reduced(s, 1)
                        if notify_reduced[i]:
                            with progress.cond:
                                progress.reduced_step[i] = s + 1
                                progress.cond.notify_all()
                    pos += 1
                rec = self.steps.record(s)
                rec.t_last_done = max(rec.t_last_done, t_done)
            elif kind is StepHyperParameters:
                self._snapshots[event.step] = event.groups
            elif kind is Stop:
                return False
            try:
                event = get_nowait()
            except empty:
                return True

    def _apply_ready(self) -> None:
        """Apply the updates of every step whose hyper-parameters are known, in step order."""
        progress, ready, snapshots, updated = (
            self.progress,
            self._ready,
            self._snapshots,
            self._updated,
        )
        n = self.layout.n
        whole_step = self.clip is not None or self.scaler is not None
        for s in sorted(ready):
            if s not in snapshots:
                continue
            snapshot = snapshots[s]
            if whole_step and snapshot is not None and len(ready[s]) < n:
                continue
            idxs = ready.pop(s)
            if snapshot is not None:  # None: the reduced gradients carry into step s+1
                self._apply(s, idxs, snapshot)
            self.device_sync.after_update(idxs)
            done = updated.get(s, 0) + len(idxs)
            if done == n:
                self._step_done(s)
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

    def _step_done(self, s: int) -> None:
        """Every update of step s has been applied (before the step is marked completed)."""

    def _used(self, s: int, idxs: list[int]) -> list[int]:
        """Parameters some rank used in step s. A parameter used here is used; only the others need
        the reduced "used" flag, read from the buffer (a host synchronisation on a GPU, paid only by
        models with locally unused parameters)."""
        local_used = self.local_used
        maybe = [i for i in idxs if local_used[i] != s]
        if not maybe:
            return idxs
        layout = self.layout
        flags = layout.flat[[layout.flag_index(i) for i in maybe]].tolist()
        elsewhere = {i for i, flag in zip(maybe, flags) if flag > 0}
        return [i for i in idxs if local_used[i] == s or i in elsewhere]

    def _apply(self, s: int, idxs: list[int], snapshot: list[list[dict]]) -> None:
        """Apply step s's optimizer updates to parameters whose gradients are reduced."""
        layout = self.layout
        used = self._used(s, idxs)
        dropped = self.dropped
        used = [i for i in used if dropped[i] != s]
        if self.scaler is not None and self._unscale_found_inf(s, used):
            self.skipped_steps += 1
            return
        if self.clip is not None:
            total = clip_in_parameter_order(
                [(i, layout.grad_views[i]) for i in used], self.clip, self.clip_norm_type
            )
            if total is not None:
                self.last_grad_norm = total
        by_group: dict[tuple[int, int], list[torch.Tensor]] = {}
        for i in used:
            own = self.owner[i]
            if own is None:
                continue
            alias = self.aliases[i]
            alias.grad = layout.grad_views[i]
            by_group.setdefault(own, []).append(alias)
        if not by_group:
            return
        try:
            for k, optimizer in enumerate(self.optimizers):
                groups = sorted((g, aliases) for (o, g), aliases in by_group.items() if o == k)
                if not groups:
                    continue
                if len(snapshot[k]) != len(optimizer.param_groups):
                    raise SchedulerError(
                        "an optimizer's param_groups changed after construction; "
                        "build a new ScheduledOptimizer after add_param_group()"
                    )
                worker = self._workers[k]
                worker.param_groups = [
                    dict(snapshot[k][g], params=aliases) for g, aliases in groups
                ]
                self._steps_of[k](worker)
        finally:
            for aliases in by_group.values():
                for alias in aliases:
                    alias.grad = None

    def _unscale_found_inf(self, s: int, used: list[int]) -> bool:
        """GradScaler's unscale + inf check + scale update on the reduced gradients of a whole step
        (the unscale and check already done when the loop called `scaler.unscale_(opt)`)."""
        scaler = self.scaler
        scale = scaler._scale
        if scale is None:
            raise SchedulerError("grad_scaler is set but scaler.scale(loss) was never called")
        found_inf = self.unscaled.pop(s, None)
        if found_inf is None:
            found_inf = unscale(scale, [self.layout.grad_views[i] for i in used])
        torch._amp_update_scale_(
            scale,
            scaler._growth_tracker,
            found_inf,
            scaler._growth_factor,
            scaler._backoff_factor,
            scaler._growth_interval,
        )
        return bool(found_inf.item())
